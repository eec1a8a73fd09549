"""What `model=` may name besides a safetensors folder: a Hugging Face id in the local
cache, a folder of `pytorch_model*.bin` files, a `.gguf` file; each must give the greedy
tokens transformers' `from_pretrained` gives for the same source. Quantized checkpoints
and unknown names are one-line errors."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import struct

import pytest
import torch
import transformers as tf
import zoo

from offload import LLM, SamplingParams
from offload.cli import main
from offload.errors import ModelError, UntrustedCacheError
from offload.model import sources
from offload.model.default import gguf_path

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = "t5 t6 t7 t8"


@pytest.fixture(autouse=True)
def own_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "offload-cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _transformers_tokens(folder, prompt=PROMPT, **kwargs):
    tokenizer = tf.AutoTokenizer.from_pretrained(folder, **kwargs)
    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    return ids[0].tolist(), out[0, ids.shape[1] :].tolist()


def _ours(model, prompt_ids):
    llm = LLM(model, device="cpu", dtype="float32")
    [output] = llm.generate({"prompt_token_ids": prompt_ids}, GREEDY)
    return output.outputs[0].token_ids


def _hub_layout(cache, repo, files_from):
    """`files_from`'s files as the hub cache holds a snapshot of `repo`."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    root = cache / f"models--{repo.replace('/', '--')}"
    shutil.copytree(files_from, root / "snapshots" / revision)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(revision)
    return root / "snapshots" / revision


def test_a_hub_id_in_the_local_cache_gives_transformers_tokens(tmp_path):
    snapshot = _hub_layout(
        tmp_path / "hf-cache", "tiny-org/tiny-llama", zoo.save_tiny_llm(tmp_path / "t", 2)
    )
    prompt_ids, expected = _transformers_tokens(snapshot)
    assert sources.resolve_model("tiny-org/tiny-llama") == snapshot
    assert _ours("tiny-org/tiny-llama", prompt_ids) == expected


def test_a_hub_id_not_in_the_cache_offline_is_one_line(capsys):
    with pytest.raises(ModelError, match=r"^nobody/nothing is not in the local Hugging Face"):
        sources.resolve_model("nobody/nothing")
    assert main(["generate", "--model", "nobody/nothing"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("offload: error: nobody/nothing is not in the local")
        and err.count("\n") == 1
    )


def _bin_folder(tmp_path, shards):
    """A tiny Llama saved the old way: pytorch_model.bin, or shards with an index."""
    source = zoo.save_tiny_llm(tmp_path / "source", 2)
    folder = tmp_path / "bin-model"
    folder.mkdir()
    for name in os.listdir(source):
        if not name.startswith("model"):
            shutil.copy2(source / name, folder / name)
    state = tf.AutoModelForCausalLM.from_pretrained(source).state_dict()
    names = sorted(state)
    if shards == 1:
        torch.save(state, folder / "pytorch_model.bin")
        return folder
    weight_map = {}
    for number in range(shards):
        part = names[number::shards]
        shard = f"pytorch_model-{number + 1:05d}-of-{shards:05d}.bin"
        torch.save({n: state[n] for n in part}, folder / shard)
        weight_map.update(dict.fromkeys(part, shard))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return folder


@pytest.mark.parametrize("shards", [1, 3])
def test_a_bin_folder_is_converted_once_and_gives_transformers_tokens(
    tmp_path, shards, monkeypatch
):
    folder = _bin_folder(tmp_path, shards)
    prompt_ids, expected = _transformers_tokens(folder)
    assert _ours(folder, prompt_ids) == expected
    converted = sources.resolve_model(folder)
    assert converted.parent.parent == tmp_path / "offload-cache"
    assert len(list(converted.glob("*.safetensors"))) == shards
    calls = []
    monkeypatch.setattr(sources, "_from_bin", lambda *args: calls.append(args))
    assert sources.resolve_model(folder) == converted and calls == []  # once
    source = next(folder.glob("pytorch_model*.bin"))
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))
    assert sources.resolve_model(folder) != converted  # a changed source converts again
    assert len(calls) == 1


@pytest.mark.parametrize("damage", ["no config.json", "a file in its place"])
def test_a_damaged_conversion_is_converted_again_and_no_lock_file_stays(tmp_path, damage):
    folder = _bin_folder(tmp_path, 1)
    converted = sources.resolve_model(folder)
    into = converted.parent
    assert [p.name for p in into.iterdir()] == [converted.name]  # no lock file left
    if damage == "no config.json":
        (converted / "config.json").unlink()
    else:
        shutil.rmtree(converted)
        converted.write_text("not a folder")
    with pytest.warns(UserWarning, match="is not a whole conversion .*; converting again"):
        assert sources.resolve_model(folder) == converted
    assert (converted / "config.json").is_file() and list(converted.glob("*.safetensors"))
    assert [p.name for p in into.iterdir()] == [converted.name]
    prompt_ids, expected = _transformers_tokens(folder)
    assert _ours(converted, prompt_ids) == expected


def test_a_swapped_conversion_is_not_used_and_is_converted_again(tmp_path):
    """A converted safetensors replaced by other weights of the same names and shapes: its
    signature does not check, so it is thrown away with a warning and converted again."""
    from safetensors.torch import load_file, save_file

    folder = _bin_folder(tmp_path, 1)
    prompt_ids, expected = _transformers_tokens(folder)
    converted = sources.resolve_model(folder)
    [weights] = converted.glob("*.safetensors")
    other = {name: torch.zeros_like(tensor) for name, tensor in load_file(weights).items()}
    save_file(other, weights, metadata={"format": "pt"})
    assert _ours(converted, prompt_ids) != expected  # (what the swapped weights would give)
    with pytest.warns(UserWarning, match=rf"is not used \({weights.name} .*; converting again"):
        assert sources.resolve_model(folder) == converted
    assert _ours(converted, prompt_ids) == expected


def test_an_offload_folder_others_may_write_is_refused_in_one_line(tmp_path):
    folder = _bin_folder(tmp_path, 1)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(UntrustedCacheError) as info:
        sources.resolve_model(folder, offload_folder=shared)
    assert str(info.value) == (
        f"the offload folder {shared} is writable by its group or others (mode 0777): chmod "
        f"go-w {shared}, or give --offload-folder (offload_folder=) a folder of your own"
    )
    assert list(shared.iterdir()) == []


class _RunsCode:
    """Unpickled, it would create the file it names."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_bin_that_holds_code_is_refused_in_one_line_and_none_of_it_runs(tmp_path):
    folder = _bin_folder(tmp_path, 1)
    marker = tmp_path / "the code ran"
    state = torch.load(folder / "pytorch_model.bin", weights_only=True)
    torch.save({**state, "extra": _RunsCode(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(ModelError, match="holds code, not only tensors: refused") as info:
        sources.resolve_model(folder)
    assert "\n" not in str(info.value) and not marker.exists()
    assert not list((tmp_path / "offload-cache" / "converted").glob(f"{folder.name}-*"))


def _gguf_like(path, head: bytes, size: int):
    path.write_bytes(head + b"\0" * (size - len(head)))
    return path


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda p: p.write_bytes(gguf_path().read_bytes()[:100_000]), "damaged or truncated"),
        (
            lambda p: _gguf_like(p, b"GGUF" + struct.pack("<IQQ", 3, 2**63, 1), 4096),
            "lists 9223372036854775808 tensors and 1 settings, more than its 4096 bytes",
        ),
        (lambda p: _gguf_like(p, b"GGUF" + struct.pack("<IQQ", 99, 1, 1), 4096), "version 99"),
        (lambda p: p.write_bytes(b"not a gguf at all"), "is not a GGUF file"),
    ],
    ids=["truncated", "2**63 tensors", "version", "not gguf"],
)
def test_a_damaged_gguf_is_one_line_naming_it(tmp_path, make, needle):
    path = tmp_path / "model.gguf"
    make(path)
    with pytest.raises(ModelError, match=r"converting .*model\.gguf to safetensors failed") as info:
        sources.resolve_model(path)
    assert needle in str(info.value) and "\n" not in str(info.value)
    assert not list((tmp_path / "offload-cache" / "converted").glob("model-*"))


def test_a_file_size_limit_during_conversion_is_named_and_leaves_nothing(tmp_path):
    """As a full disk: the limit stops the write (EFBIG), safetensors reports it."""
    folder = _bin_folder(tmp_path, 1)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error, not a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))
    try:
        with pytest.raises(ModelError, match="the disk is full or the file-size limit") as info:
            sources.resolve_model(folder)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert "\n" not in str(info.value)
    converted = tmp_path / "offload-cache" / "converted"
    assert [p.name for p in converted.iterdir()] == []  # no staging folder, no lock file
    assert sources.resolve_model(folder).is_dir()  # and it converts once there is room


def test_a_gguf_file_gives_transformers_tokens(short_gguf):
    """With a dtype, a .gguf is converted by transformers' own GGUF reader and saved: its
    model, loaded back by transformers, is the one to agree with (reading the GGUF through
    transformers a second time would take 15 s more). The default model's first blocks
    (tests/short_model.py): the whole model's conversion took 20 s here."""
    gguf = short_gguf
    converted = sources.resolve_model(gguf)
    assert converted.parent.name == "converted"
    prompt_ids, expected = _transformers_tokens(converted, "The capital of France is")
    assert _ours(gguf, prompt_ids) == expected


def test_a_quantized_checkpoint_is_refused_naming_its_method(tmp_path, capsys):
    folder = zoo.save_tiny_llm(tmp_path / "gptq", 2)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ModelError, match=r"quantized checkpoints are not supported yet \(quant_method bitsandb"
    ):
        LLM(folder)
    assert main(["inspect", str(folder)]) == 2
    assert "quant_method bitsandbytes" in capsys.readouterr().err
    # A method that is read, over a checkpoint of float tensors: said as such.
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=r"quant_method gptq, but no layer's tensors are quantiz"):
        LLM(folder)


def test_a_file_that_is_not_a_model_says_what_is_accepted(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(ModelError, match="is not a model: give a folder with safetensors"):
        LLM(path)


def test_a_dummy_shipped_shape_runs_from_token_ids_without_a_tokenizer(tmp_path, monkeypatch):
    from offload.model import configs

    shapes = tmp_path / "shapes"
    zoo.save_tiny_llm(tmp_path / "tiny", 2)
    (shapes / "tiny-shape").mkdir(parents=True)
    shutil.copy2(tmp_path / "tiny" / "config.json", shapes / "tiny-shape" / "config.json")
    monkeypatch.setattr(configs, "CONFIGS", shapes)
    llm = LLM("tiny-shape", load_format="dummy", device="cpu")
    [output] = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)
    assert len(output.outputs[0].token_ids) == 8 and output.outputs[0].text == ""
    with pytest.raises(ModelError, match="has no tokenizer"):
        llm.generate("t5 t6", GREEDY)


def test_a_bin_folder_streams_from_its_conversion_in_offload_folder(tmp_path):
    """With a disk tier, a checkpoint that is not safetensors is converted once into
    `offload_folder` and its layers are read from there."""
    folder = _bin_folder(tmp_path, 2)
    prompt_ids, expected = _transformers_tokens(folder)
    into = tmp_path / "offload-folder"
    llm = LLM(folder, device="cpu", dtype="float32", cpu_memory_gb=0, offload_folder=str(into))
    [output] = llm.generate({"prompt_token_ids": prompt_ids}, GREEDY)
    assert output.outputs[0].token_ids == expected
    moved = llm.transfer_stats()  # read, or mapped where the conversion is in the page cache
    assert moved.disk_read_bytes + moved.disk_mapped_bytes > 0
    [converted] = [p for p in into.iterdir() if not p.name.startswith(".")]  # (and a lock)
    assert converted.name.startswith(folder.name) and list(converted.glob("*.safetensors"))
    assert not (tmp_path / "offload-cache" / "converted").exists()
    llm.close()
