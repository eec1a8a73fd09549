"""The quantized safetensors formats vLLM loads (compressed-tensors, GPTQ, AWQ, FP8) on a
real GPU: every format's weights de-quantize there to the CPU's values bit for bit, its
model's logits equal those of the float checkpoint of the same values on the GPU, and
offloaded every way (and decoded with CUDA graphs) it gives its resident tokens.

The checkpoints come from tests/packed_zoo.py. compressed-tensors' packer is not on the GPU
machines: there, OFFLOAD_TEST_PACKED names a folder where they were written beforehand
(`python -c "import packed_zoo; packed_zoo.save_all(DIR)"` in tests/)."""

from __future__ import annotations

import gc
import importlib.util
import os
from pathlib import Path

import packed_zoo
import pytest
import torch
import zoo

from offload import LLM, SamplingParams
from offload.model.loader import load_model
from offload.quant.packed_modules import PackedLinear
from offload.quant.packed_quant import dequantize_packed

pytestmark = pytest.mark.cuda
DEVICE = "cuda"
PROMPTS = ["t5 t6 t7 t8 t9 t10", "t100 t20", "t3 t4 t5 t6 t7 t8 t9 t10 t11 t12 t13"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
SETTINGS = {
    "uva": {"cpu_offload_gb": 1.5e-5},  # (about half the layers' stored bytes)
    "prefetch": {"offload_group_size": 1, "offload_prefetch_step": 1},
    "prefetch+kv-cache": {"offload_group_size": 1, "offload_prefetch_step": 1, "kv_offload": True},
}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    made = os.environ.get("OFFLOAD_TEST_PACKED")
    if made:
        root = Path(made)
    else:
        root = tmp_path_factory.mktemp("packed")
        if importlib.util.find_spec("compressed_tensors") is None:
            pytest.skip("no compressed-tensors to write the checkpoints, nor OFFLOAD_TEST_PACKED")
        packed_zoo.save_all(root)
    return {fmt: (root / fmt, root / f"{fmt}-float") for fmt in packed_zoo.FORMATS}


def _free():
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("fmt", packed_zoo.FORMATS)
def test_every_format_dequantizes_on_the_gpu_to_the_cpus_values(pairs, fmt):
    quantized, floats = pairs[fmt]
    on_cpu, _ = load_model(quantized)
    on_gpu, _ = load_model(quantized, device=DEVICE)
    gpu_layers = dict(on_gpu.named_modules())
    layers = {n: m for n, m in on_cpu.named_modules() if isinstance(m, PackedLinear)}
    assert len(layers) == 2 * 7
    for name, layer in layers.items():
        there = gpu_layers[name]
        tensors = [getattr(there, n) for n in there._used]
        assert all(t.device.type == DEVICE for t in tensors), name
        weight = dequantize_packed(there.form, tensors)
        assert weight.device.type == DEVICE
        expected = dequantize_packed(layer.form, [getattr(layer, n) for n in layer._used])
        assert torch.equal(weight.cpu(), expected), name
    reference, _ = load_model(floats, device=DEVICE)
    ids = zoo.inputs().to(DEVICE)
    got, wanted = zoo.logits(on_gpu, ids), zoo.logits(reference, ids)
    assert torch.equal(got, wanted), float((got - wanted).abs().max())
    del on_gpu, reference
    _free()


def _tokens(path, **settings):
    with LLM(path, device=DEVICE, **settings) as llm:
        tokens = [
            o.outputs[0].token_ids
            for params in (GREEDY, SAMPLED)
            for o in llm.generate(PROMPTS, params, use_tqdm=False)
        ]
        moved = llm.transfer_stats()
    _free()
    return tokens, moved


@pytest.mark.parametrize("fmt", packed_zoo.FORMATS)
def test_offloaded_and_graphs_equal_resident_on_the_gpu(pairs, fmt):
    """Every format under CUDA graphs (its de-quantization captured: nothing in it may copy
    from the host); four of them offloaded every way."""
    quantized, floats = pairs[fmt]
    resident, _ = _tokens(quantized, enforce_eager=True)
    assert resident[: len(PROMPTS)] == _tokens(floats, enforce_eager=True)[0][: len(PROMPTS)]
    graphs, moved = _tokens(quantized)
    assert graphs == resident and moved.num_graph_replays > 0
    if fmt not in ("ct-w4a16", "gptq-act-order", "awq", "fp8-block"):
        return
    for name, settings in SETTINGS.items():
        tokens, moved = _tokens(quantized, **settings)
        assert tokens == resident, name
        if "offload_prefetch_step" in settings:
            assert moved.weight_copied_bytes > 0, name
