"""Every GGUF type read as stored, in a model (the default model's file has only Q4_1 and
Q8_0): a small Llama whose every matrix is random blocks of one type. In GGUF's own blocks
its logits are those of the float32 model of the de-quantized weights, bit for bit; in the
CPU's kernel layouts they are those to bfloat16 rounding; offloaded (prefetch, the disk
tier, UVA with the KV cache in host memory) it gives its resident logits bit for bit and
moves its stored bytes, never a float copy."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
import zoo
from safetensors.torch import load_file

from offload.model.loader import load_model
from offload.quant.gguf_quants import FORMATS, dequantize

SHAPE = {**zoo.GGUF_TYPE_SHAPE, "num_hidden_layers": 2}
IDS = torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(5))
OFFLOADED = {
    "prefetch": {"offload_group_size": 1, "offload_num_in_group": 1, "offload_prefetch_step": 1},
    "disk": {"cpu_memory_gb": 0, "disk_io": "direct"},
}


@pytest.fixture(scope="module", params=list(FORMATS))
def written(request, tmp_path_factory):
    """(type, the checkpoint in GGUF's blocks, the same bytes laid out for the CPU)."""
    kind, root = request.param, tmp_path_factory.mktemp(request.param)
    blocks = zoo.save_gguf_type_llm(root / "gguf", kind, kernels="gguf")
    return kind, blocks, zoo.save_gguf_type_llm(root / "cpu", kind, kernels="cpu")


@torch.no_grad()
def _logits(model):
    return model(input_ids=IDS).logits


def _float_model(blocks_path, kind):
    """The float32 model of the checkpoint's de-quantized weights."""
    tensors = {}
    for shard in sorted(blocks_path.glob("*.safetensors")):
        tensors.update(load_file(shard))
    types = json.loads((blocks_path / "config.json").read_text())["quantization_config"]
    assert set(types["weight_types"].values()) == {kind}
    weights = {
        name: dequantize(raw, kind).reshape(raw.shape[0], -1) if name in types["weight_types"]
        else raw
        for name, raw in tensors.items()
    }  # fmt: skip
    model = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**SHAPE)).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("rotary" in name for name in missing), (missing, unexpected)
    return model


def test_in_blocks_the_logits_are_the_dequantized_float32_models(written):
    kind, blocks, _ = written
    model, _ = load_model(blocks)
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "GGUFLinear"
    expected = _logits(_float_model(blocks, kind))
    assert expected.abs().max() < 100 and expected.std() > 0  # (weights of a sane size)
    assert torch.equal(_logits(model), expected)


def test_in_the_cpu_layouts_the_logits_are_the_float_models_to_bfloat16_rounding(written):
    kind, blocks, laid_out = written
    model, _ = load_model(laid_out)
    got, expected = _logits(model), _logits(_float_model(blocks, kind))
    error = float((got - expected).norm() / expected.norm())
    assert error < 0.02, error


@pytest.mark.parametrize("setting", list(OFFLOADED))
def test_offloaded_equals_resident_and_moves_the_stored_bytes(written, setting):
    kind, blocks, laid_out = written
    resident, _ = load_model(laid_out)
    expected = _logits(resident)
    model, offloader = load_model(laid_out, OFFLOADED[setting])
    for _ in range(2):
        assert torch.equal(_logits(model), expected)
    offloader.sync_prev_onload()
    stats = offloader.stats()
    moved = stats.bytes_copied + stats.disk.bytes_read + stats.disk.bytes_mapped
    stored = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    floats = sum(p.numel() * 4 for p in _float_model(blocks, kind).model.layers.parameters())
    assert 0 < offloader.offloaded_bytes <= stored
    assert offloader.offloaded_bytes <= moved <= 3 * offloader.offloaded_bytes
    if kind != "Q8_0":  # (8.5 bits a weight in blocks; the CPU's q8 keeps 8 plus scales)
        assert stored < floats / 3
    offloader.close()
