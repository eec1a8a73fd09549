"""Quantized safetensors checkpoints (compressed-tensors, GPTQ, AWQ, FP8) kept as stored:
each layer's weight de-quantizes to its format's reference values bit for bit, the model
gives the logits of the float model of those values, and offloading moves the stored bytes
and changes no bit."""

from __future__ import annotations

import json
import re

import packed_zoo
import pytest
import torch
import zoo
from safetensors.torch import load_file

from offload import LLM, SamplingParams
from offload.errors import ConfigError, ModelError
from offload.model.loader import load_model
from offload.quant.packed_modules import PackedLinear
from offload.quant.packed_quant import dequantize_packed

pytest.importorskip("compressed_tensors")  # (the reference for its formats; a test extra)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    return {fmt: packed_zoo.save_pair(root, fmt) for fmt in packed_zoo.FORMATS}


def _packed(model):
    return {name: m for name, m in model.named_modules() if isinstance(m, PackedLinear)}


@pytest.mark.parametrize("fmt", packed_zoo.FORMATS)
def test_weights_and_logits_equal_the_reference_dequantization(pairs, fmt):
    quantized, floats = pairs[fmt]
    model, _ = load_model(quantized)
    reference, _ = load_model(floats)
    values = load_file(floats / "model.safetensors")
    layers = _packed(model)
    assert len(layers) == 2 * 7  # every projection of both layers, not the head
    for name, layer in layers.items():
        tensors = [getattr(layer, n) for n in layer._used]
        weight = dequantize_packed(layer.form, tensors)
        assert torch.equal(weight.float(), values[f"{name}.weight"]), name
    ids = zoo.inputs()
    assert torch.equal(zoo.logits(model, ids), zoo.logits(reference, ids))


@pytest.mark.parametrize(
    "flags",
    [
        {"offload_group_size": 1, "offload_num_in_group": 1, "offload_prefetch_step": 1},
        {"cpu_memory_gb": 0, "disk_io": "direct"},
        {"cpu_offload_gb": 1.5e-5},  # (about half the layers' stored bytes),
    ],
    ids=["prefetch", "disk", "uva"],
)
@pytest.mark.parametrize("fmt", packed_zoo.FORMATS)
def test_offloaded_equals_resident_and_moves_the_stored_bytes(pairs, fmt, flags):
    quantized, _ = pairs[fmt]
    ids = zoo.inputs()
    resident, _ = load_model(quantized)
    expected = zoo.logits(resident, ids)
    model, offloader = load_model(quantized, flags)
    assert torch.equal(zoo.logits(model, ids), expected)
    offloader.sync_prev_onload()
    stats = offloader.stats()
    moved = stats.bytes_copied + stats.disk.bytes_read + stats.disk.bytes_mapped
    stored = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    floats = sum(m.in_features * m.out_features * 4 for m in _packed(model).values())
    assert 0 < offloader.offloaded_bytes <= stored < floats
    if "cpu_offload_gb" not in flags:
        assert offloader.offloaded_bytes <= moved <= 2 * offloader.offloaded_bytes
    offloader.close()


def test_compiled_offloaded_equals_compiled_resident(pairs):
    quantized, _ = pairs["gptq-act-order"]
    ids = zoo.inputs()
    torch._dynamo.reset()
    resident, _ = load_model(quantized)
    with torch.no_grad():
        expected = torch.compile(resident, fullgraph=True)(input_ids=ids).logits
    torch._dynamo.reset()
    flags = {"offload_group_size": 1, "offload_num_in_group": 1, "offload_prefetch_step": 1}
    model, offloader = load_model(quantized, flags)
    with torch.no_grad():
        assert torch.equal(torch.compile(model, fullgraph=True)(input_ids=ids).logits, expected)
    offloader.close()
    torch._dynamo.reset()


@pytest.mark.parametrize("quantization", [None, "gptq", "gptq_marlin"])
def test_llm_generates_the_float_models_tokens(pairs, quantization):
    quantized, floats = pairs["gptq"]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    with LLM(floats, device="cpu") as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(["a b c", "d e"], params)]
    with LLM(quantized, device="cpu", quantization=quantization, kv_offload=True) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(["a b c", "d e"], params)]
    assert got == expected


def test_the_planner_times_a_layer_of_a_packed_model(pairs):
    """The planner's probe builds the model cut to a few layers with dummy weights: the cut
    config carries the forms of those layers as the files say them."""
    from offload.model.build import build_empty
    from offload.planner.shape import shape_of
    from offload.probes.compute import time_decode

    quantized, _ = pairs["awq"]
    shape = shape_of(build_empty(quantized, "auto"), 16)
    layer_s, rest_s = time_decode(quantized, shape, torch.device("cpu"), [1], 16, repeats=2)
    # The rest of the step (embedding, norm, head of a 64-wide model) is the difference of
    # two noisy timings, clamped at zero; a layer's time is retried until it is positive.
    assert layer_s[0] > 0 and rest_s[0] >= 0


def _rewrite(path, tmp_path, change):
    """A copy of the checkpoint at `path` whose config's quantization_config `change` edits."""
    out = tmp_path / f"{path.name}-edited"
    out.mkdir()
    for file in path.iterdir():
        (out / file.name).write_bytes(file.read_bytes())
    config = json.loads((out / "config.json").read_text())
    change(config["quantization_config"])
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(
    ("fmt", "change", "message"),
    [
        ("gptq", lambda s: s.update(bits=3), r"GPTQ bits 3 is not read \(read: 2, 4, 8\)"),
        ("awq", lambda s: s.update(version="gemv"), r"AWQ version gemv.*is not read"),
        ("ct-w4a16", lambda s: s.update(format="marlin-24"), r"format marlin-24 is not read"),
        ("gptq", lambda s: s.update(bits=8), r"does not hold a 64x64 weight as gptq"),
    ],
)
def test_bad_settings_get_one_line(pairs, tmp_path, fmt, change, message):
    edited = _rewrite(pairs[fmt][0], tmp_path, change)
    with pytest.raises(ModelError, match=message) as caught:
        load_model(edited)
    assert "\n" not in str(caught.value)


def test_quantization_must_match_the_checkpoint(pairs):
    _, floats = pairs["gptq"]
    with pytest.raises(ModelError, match=r"quant_method gptq; .* is not quantized"):
        LLM(floats, device="cpu", quantization="gptq")
    with pytest.raises(ModelError, match=r"quant_method awq; .* is quant_method gptq"):
        LLM(pairs["gptq"][0], device="cpu", quantization="awq")
    with pytest.raises(ConfigError, match=r"quantization='bitsandbytes' is not supported"):
        LLM(floats, device="cpu", quantization="bitsandbytes")


def test_the_checkpoint_holds_no_float_copy_of_a_packed_weight(pairs):
    quantized, _ = pairs["ct-w4a16"]
    names = load_file(quantized / "model.safetensors")
    assert not [n for n in names if re.search(r"layers\.\d+\..*proj\.weight$", n)]


def test_every_fp8_code_reads_as_torchs_conversion():
    """The float16-bits reading of E4M3 codes (a 256x larger scale beside it) gives every
    value torch's own conversion gives, subnormals and signs included."""
    from offload.quant.packed_quant import _FP8_UNIT, _fp8_floats

    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    expected = codes.to(torch.float32)
    read = _fp8_floats(codes) * _FP8_UNIT
    numbers = ~expected.isnan()
    assert numbers.sum() == 254 and torch.equal(read[numbers], expected[numbers])
