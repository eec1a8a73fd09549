"""Packed checkpoints whose settings or small tensors lie (issue 48's red team): each
refused in one line naming the setting or tensor and what is allowed, when the model is
built, before a weight is read."""

from __future__ import annotations

import json

import packed_zoo
import pytest
import torch
from safetensors.torch import load_file, save_file

from offload.errors import ModelError
from offload.model.build import build_empty

pytest.importorskip("compressed_tensors")  # (packed_zoo writes its formats with it)

_FORMATS = ("gptq", "gptq-act-order", "awq", "ct-w4a16", "ct-fp8", "fp8-block", "fp8-tensor")
_LAYER = "model.layers.0.self_attn.q_proj"  # (64 inputs; the zoo's groups are of 32)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    return {fmt: packed_zoo.save_pair(root, fmt)[0] for fmt in _FORMATS}


def _edited(source, tmp_path, settings=None, tensors=None):
    """A copy of the checkpoint `source` whose quantization_config `settings` edits and
    whose tensors {name: tensor} `tensors` edits (in place)."""
    out = tmp_path / f"{source.name}-edited"
    out.mkdir()
    for file in source.iterdir():
        (out / file.name).write_bytes(file.read_bytes())
    if settings is not None:
        config = json.loads((out / "config.json").read_text())
        settings(config["quantization_config"])
        (out / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        stored = load_file(out / "model.safetensors")
        tensors(stored)
        save_file(stored, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _refused(path, needle: str) -> None:
    with pytest.raises(ModelError, match=needle) as info:
        build_empty(path, "auto")
    assert "\n" not in str(info.value)


def _set(name: str, make):
    """A tensor edit: `name` of the first layer's query replaced by `make(old)`."""
    return lambda stored: stored.__setitem__(f"{_LAYER}.{name}", make(stored[f"{_LAYER}.{name}"]))


def _nan_at_first(tensor):
    tensor = tensor.clone()
    tensor.view(-1)[0] = float("nan")
    return tensor


@pytest.mark.parametrize(
    ("group_size", "needle"),
    [
        (0, r"GPTQ group_size 0 is not read \(read: -1, one group a row, or a positive"),
        (-1, r"q_proj\.scales holds 2 groups; group_size -1 over 64 inputs makes 1"),
        (7, r"q_proj: group_size 7 does not divide its 64 inputs"),
        (10**9, r"q_proj: group_size 1000000000 does not divide its 64 inputs"),
        ("32", r"GPTQ group_size '32' is not read"),
    ],
)
def test_a_gptq_group_size_the_scales_do_not_have_is_refused(pairs, tmp_path, group_size, needle):
    edited = _edited(pairs["gptq"], tmp_path, lambda s: s.update(group_size=group_size))
    _refused(edited, needle)


def test_a_gptq_marlin_checkpoint_format_is_refused(pairs, tmp_path):
    edited = _edited(pairs["gptq"], tmp_path, lambda s: s.update(checkpoint_format="marlin"))
    _refused(edited, r"GPTQ checkpoint_format 'marlin' is not read \(read: gptq, gptq_v2\)")


@pytest.mark.parametrize(
    ("fmt", "make", "needle"),
    [
        ("gptq-act-order", lambda g: g + 1, r"q_proj\.g_idx holds groups 1 to 2; its scales hold"),
        ("gptq", lambda g: g - 1, r"q_proj\.g_idx holds groups -1 to 0; its scales hold groups"),
        ("gptq", lambda g: g[:10].clone(), r"q_proj\.g_idx has shape \[10\]; it must be \[64\]"),
        ("gptq", lambda g: g.float(), r"q_proj\.g_idx is torch\.float32; it must be int32"),
    ],
    ids=["act-order out of range", "negative", "short", "float"],
)
def test_a_g_idx_that_is_not_a_group_of_each_input_is_refused(pairs, tmp_path, fmt, make, needle):
    _refused(_edited(pairs[fmt], tmp_path, tensors=_set("g_idx", make)), needle)


def test_a_float32_qweight_is_refused(pairs, tmp_path):
    edited = _edited(pairs["gptq"], tmp_path, tensors=_set("qweight", lambda q: q.float()))
    _refused(edited, r"q_proj\.qweight is torch\.float32; it must be int32")


@pytest.mark.parametrize("group_size", [0, 16, 32.0])
def test_an_awq_group_size_its_kernels_do_not_take_is_refused(pairs, tmp_path, group_size):
    edited = _edited(pairs["awq"], tmp_path, lambda s: s.update(group_size=group_size))
    _refused(edited, rf"AWQ group_size {group_size} is not one AWQ's kernels take \(read: -1,")


def test_gptq_bits_that_are_not_an_integer_are_refused(pairs, tmp_path):
    edited = _edited(pairs["gptq"], tmp_path, lambda s: s.update(bits=4.0))
    _refused(edited, r"GPTQ bits 4\.0 is not read \(read: 2, 4, 8\)")


def _ct_weights(**change):
    return lambda s: s["config_groups"]["group_0"]["weights"].update(change)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (_ct_weights(num_bits=3), r"group_0\.weights: type 'int' of num_bits 3 is not read"),
        (_ct_weights(num_bits=16), r"type 'int' of num_bits 16 is not read \(int: 4, 8; float"),
        (
            _ct_weights(num_bits=8),
            r"weight_packed holds 4-bit values; config_groups say num_bits 8",
        ),
        (_ct_weights(strategy="diagonal"), r"strategy 'diagonal' is not read \(read: tensor,"),
        (_ct_weights(group_size=16), r"weight_scale holds 2 groups; group_size 16 over 64 inp"),
        (
            lambda s: s["config_groups"]["group_0"].update(targets=["Conv2d"]),
            r"group_0 targets 'Conv2d', which names no module of the model",
        ),
    ],
    ids=["3 bits", "16 bits", "bits of the tensors", "strategy", "group size", "targets"],
)
def test_compressed_tensors_settings_that_are_not_read_are_refused(pairs, tmp_path, change, needle):
    _refused(_edited(pairs["ct-w4a16"], tmp_path, change), needle)


def test_a_compressed_tensors_weight_shape_that_lies_is_refused(pairs, tmp_path):
    lie = _set("weight_shape", lambda shape: torch.tensor([64, 128]))
    _refused(
        _edited(pairs["ct-w4a16"], tmp_path, tensors=lie),
        r"q_proj\.weight_shape says \[64, 128\]; the layer is \[64, 64\]",
    )


@pytest.mark.parametrize("block", [[64, 64], [16, 16]])
def test_an_fp8_block_size_the_scales_disagree_with_is_refused(pairs, tmp_path, block):
    edited = _edited(pairs["fp8-block"], tmp_path, lambda s: s.update(weight_block_size=block))
    _refused(edited, r"q_proj\.weight_scale_inv has shape \[2, 2\]; blocks of")


@pytest.mark.parametrize(
    ("fmt", "scale"),
    [
        ("gptq", "scales"),
        ("awq", "scales"),
        ("ct-w4a16", "weight_scale"),
        ("ct-fp8", "weight_scale"),
        ("fp8-block", "weight_scale_inv"),
        ("fp8-tensor", "weight_scale"),
    ],
)
def test_a_nan_scale_is_named_at_load_not_blamed_on_the_dtype(pairs, tmp_path, fmt, scale):
    edited = _edited(pairs[fmt], tmp_path, tensors=_set(scale, _nan_at_first))
    _refused(edited, rf"q_proj\.{scale} holds 1 nan or inf values: the checkpoint is damaged")


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_a_config_without_a_group_size_takes_the_scales_groups(pairs, tmp_path, fmt):
    edited = _edited(pairs[fmt], tmp_path, lambda s: s.pop("group_size"))
    assert build_empty(edited, "auto") is not None
