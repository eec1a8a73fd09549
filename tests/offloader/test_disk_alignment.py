"""A checkpoint written by the safetensors library puts its tensors 8 bytes apart at best,
and a matrix product's sums depend on where its weight starts (MKL's here): the disk
tier's reads must move each weight to an aligned home, and a mapping of such a file must
not be computed on. Found 2026-11-29 with this 2-layer model (every linear weight 24 bytes
past a 64-byte boundary), whose streamed answers then differed from the resident ones in
the last bits of their logprobs."""

import json
import struct
from pathlib import Path

import pytest
import zoo

from offload import SamplingParams
from offload.errors import ModelError
from offload.llm.llm import LLM
from offload.model.loader import load_model

PROMPTS = [[5, 9, 14, 3], [7, 3], [30, 2, 8, 11, 4, 6], [12], [9, 9, 9]]
PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)


def _answers(llm) -> list:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [
        (c.token_ids, [{t: lp.logprob for t, lp in e.items()} for e in c.logprobs])
        for o in outputs
        for c in o.outputs
    ]


def _file_offsets(path) -> dict[str, int]:
    """Each matrix's first byte in model.safetensors."""
    with (path / "model.safetensors").open("rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(length))
    return {
        name: 8 + length + entry["data_offsets"][0]
        for name, entry in header.items()
        if name != "__metadata__" and len(entry["shape"]) >= 2
    }


@pytest.fixture(scope="module")
def misaligned(tmp_path_factory):
    path = zoo.save_attentive_llm(tmp_path_factory.mktemp("misaligned"), num_layers=2)
    assert any(offset % 64 for offset in _file_offsets(path).values())  # the case at hand
    with LLM(path, device="cpu", dtype="float32") as resident:
        return path, _answers(resident)


@pytest.mark.parametrize("io", ["direct", "page-cache"])
def test_weights_streamed_from_a_misaligned_checkpoint_give_the_resident_bits(misaligned, io):
    path, expected = misaligned
    with LLM(path, device="cpu", dtype="float32", cpu_memory_gb=0, disk_io=io) as llm:
        got = _answers(llm)
        stats = llm.offloader.stats().disk
        assert stats.bytes_read > 0 and stats.io == io
        matrices = [p for p in llm.model.model.layers.parameters() if p.dim() == 2]
        assert matrices and all(p.data_ptr() % 256 == 0 for p in matrices)
    assert got == expected


@pytest.mark.parametrize("io", ["auto", "mmap"])
def test_llm_maps_an_aligned_copy_of_a_misaligned_checkpoint_made_once(misaligned, io, tmp_path):
    """Where its disk tier would map the files ("auto" on a checkpoint in the page cache
    that streams, or asked), `LLM` writes them once with aligned matrices and maps those."""
    path, expected = misaligned
    for _ in range(2):
        with LLM(path, device="cpu", dtype="float32", cpu_memory_gb=0, disk_io=io) as llm:
            assert _answers(llm) == expected
            assert llm.offloader.stats().disk.io == "mmap"
            copy = Path(llm.model.config._name_or_path)
        assert copy != path and copy.name.startswith(f"{path.name}.aligned-")
        assert not any(offset % 64 for offset in _file_offsets(copy).values())
        written = (copy / "model.safetensors").stat().st_mtime_ns
    assert (copy / "model.safetensors").stat().st_mtime_ns == written  # (made once)


def test_apply_reads_a_misaligned_checkpoint_and_refuses_to_map_it(misaligned):
    """`offload.apply` streams from the files it is given: "auto" reads them through the
    page cache rather than map them, and an explicit "mmap" is one error saying why."""
    path, _ = misaligned
    config = {"cpu_memory_gb": 0, "offload_group_size": 1}
    _, offloader = load_model(path, config)  # (just written: in the page cache)
    assert offloader.stats().disk.io == "page-cache"
    offloader.close()
    with pytest.raises(ModelError, match=r"disk_io='mmap' .* do not start at a multiple of 64"):
        load_model(path, {**config, "disk_io": "mmap"})


def test_the_same_checkpoint_aligned_is_mapped_and_gives_the_resident_bits(misaligned):
    path, expected = misaligned
    zoo.realign(path)  # (last: the module's other tests read the misaligned files)
    assert not any(offset % 64 for offset in _file_offsets(path).values())
    with LLM(path, device="cpu", dtype="float32", cpu_memory_gb=0, disk_io="mmap") as llm:
        assert _answers(llm) == expected
        assert llm.offloader.stats().disk.bytes_mapped > 0
        assert Path(llm.model.config._name_or_path) == path  # (no copy)
