"""The default model's GGUF read as stored (`quantization="gguf"`): its file's own bytes in
the cache, quantized modules that de-quantize to transformers' float32 weights bit for bit,
the same tokens as the float32 model, and offloading that moves the stored bytes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from offload import LLM, SamplingParams
from offload.errors import ConfigError, ModelError
from offload.model.default import gguf_path
from offload.model.gguf_quants import dequantize
from offload.model.quantized import GGUFEmbedding, GGUFLinear
from offload.model.sources import resolve_model

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
PROMPTS = ["What is the capital of France?", "1, 2, 3,"]


@pytest.fixture(scope="module")
def stored():
    return resolve_model(None, quantization="gguf")


@pytest.fixture(scope="module")
def stored_outputs(stored):
    with LLM(stored, device="cpu") as llm:
        return _tokens_and_logprobs(llm)


def _tokens_and_logprobs(llm):
    return [
        (o.outputs[0].token_ids, o.outputs[0].logprobs)
        for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    ]


def test_the_cache_holds_the_files_own_bytes_not_floats(stored):
    tensors = load_file(stored / "model.safetensors")
    types = json.loads((stored / "config.json").read_text())["quantization_config"]
    reader = gguf.GGUFReader(gguf_path())
    by_gguf = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert (
        types["quant_method"] == "gguf"
        and types["weight_types"]["model.embed_tokens.weight"] == "Q8_0"
    )
    # A weight llama.cpp did not permute: byte for byte the file's.
    up = tensors["model.layers.3.mlp.up_proj.weight"]
    assert up.dtype == torch.uint8 and np.array_equal(up.numpy(), by_gguf["blk.3.ffn_up.weight"])
    # The query's rows are the file's rows, reordered (each row's bytes unchanged).
    query = tensors["model.layers.3.self_attn.q_proj.weight"].numpy()
    rows = {bytes(r) for r in by_gguf["blk.3.attn_q.weight"]}
    assert {bytes(r) for r in query} == rows and not np.array_equal(
        query, by_gguf["blk.3.attn_q.weight"]
    )
    size = (stored / "model.safetensors").stat().st_size
    assert size <= gguf_path().stat().st_size  # no float copy of anything
    assert not any(t.dtype == torch.float32 and t.numel() > 10_000 for t in tensors.values())


def test_dequantized_weights_equal_transformers_float32_conversion(stored, smollm2_path):
    """transformers reads the GGUF into the float32 default model: every weight we keep as
    stored de-quantizes to exactly its tensor (names, row order and values)."""
    ours = load_file(stored / "model.safetensors")
    types = json.loads((stored / "config.json").read_text())["quantization_config"]["weight_types"]
    theirs = load_file(smollm2_path / "model.safetensors")
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # (tied to the embedding)
    for name, tensor in ours.items():
        values = dequantize(tensor, types[name]) if name in types else tensor
        assert torch.equal(values, theirs[name]), name


def test_the_model_is_built_with_quantized_modules(stored):
    with LLM(stored, device="cpu") as llm:
        model = llm.model
        assert isinstance(model.model.embed_tokens, GGUFEmbedding)
        assert (
            isinstance(model.lm_head, GGUFLinear)
            and model.lm_head.weight is model.model.embed_tokens.weight
        )
        q_proj = model.model.layers[0].self_attn.q_proj
        assert (
            isinstance(q_proj, GGUFLinear)
            and q_proj.kind == "Q4_1"
            and q_proj.weight.dtype == torch.uint8
        )
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        assert held < 100 * 2**20  # 4-5 bits a weight, not 32


def test_greedy_tokens_and_logprobs_equal_the_float32_models(stored, smollm2_path):
    """Each prompt alone: bitwise. (Batched, the float32 model's lm_head product over a
    strided [2, 576] input rounds differently with where its weight lies in memory, so a
    batch is compared by tokens.)"""
    with LLM(stored, device="cpu") as quantized, LLM(smollm2_path, device="cpu") as floats:
        for prompt in PROMPTS:
            ours = quantized.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
            theirs = floats.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
            assert (ours.token_ids, ours.logprobs) == (theirs.token_ids, theirs.logprobs)
        batched = [o.outputs[0].token_ids for o in floats.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert batched == [o.outputs[0].token_ids for o in quantized.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize(
    "flags",
    [
        {"offload_group_size": 1, "offload_num_in_group": 1, "offload_prefetch_step": 2},
        {"cpu_memory_gb": 0, "disk_io": "direct"},
        {"cpu_memory_gb": 0, "disk_io": "mmap"},
        {"cpu_offload_gb": 0.05, "kv_offload": True},
    ],
    ids=["prefetch", "disk-direct", "disk-mmap", "uva+kv"],
)
def test_offloaded_as_stored_equals_resident_and_moves_the_stored_bytes(
    stored, stored_outputs, flags
):
    with LLM(stored, device="cpu", **flags) as llm:
        assert _tokens_and_logprobs(llm) == stored_outputs
        stats = llm.transfer_stats()
        offloaded = llm.offloader.offloaded_bytes
    moved = stats.weight_copied_bytes + stats.disk_read_bytes + stats.disk_mapped_bytes
    if "offload_prefetch_step" in flags or "disk_io" in flags:
        # Each forward brings every offloaded layer's stored bytes, never a float copy (the
        # prefetcher may have begun the next forward's first layers).
        forwards = stats.num_forwards
        assert forwards * offloaded <= moved <= (forwards + 1) * offloaded, (moved, forwards)
        assert offloaded < 70 * 2**20  # 30 layers of Q4_1 blocks (as float32: 405 MiB)
    if "kv_offload" in flags:
        assert stats.kv_copied_bytes > 0


def test_quantization_is_checked_before_anything_is_read(tmp_path, smollm2_path):
    with pytest.raises(
        ConfigError, match=r"quantization='gptq' is not supported \(yet; read: gguf\)"
    ):
        LLM(quantization="gptq")
    with pytest.raises(ConfigError, match="quantization must be None or one of gguf; got 'int3'"):
        LLM(quantization="int3")
    with pytest.raises(ModelError, match=r"needs a \.gguf file or a folder offload made from one"):
        LLM(smollm2_path, quantization="gguf")


PEAK = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from offload.model.build import build_empty
    from offload.model.loader import load_model

    path = Path(sys.argv[1])
    build_empty(path, "auto")  # imports the model's code first: not part of loading
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    before = status("VmRSS")
    model, offloader = load_model(path)
    print(json.dumps({"growth": status("VmHWM") - before}))
    """
)


def test_loading_as_stored_grows_rss_by_at_most_one_and_a_half_ggufs(stored):
    result = subprocess.run(
        [sys.executable, "-c", PEAK, str(stored)], capture_output=True, text=True, check=True,
        timeout=300,
    )  # fmt: skip
    growth = json.loads(result.stdout.strip().splitlines()[-1])["growth"]
    assert 0 < growth <= 1.5 * gguf_path().stat().st_size, growth / 2**20
