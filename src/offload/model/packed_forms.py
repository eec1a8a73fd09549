"""Which linear layers of a quantized safetensors checkpoint are quantized, and how: read
from the checkpoint's tensors (their names, dtypes and shapes) with the method's settings
in `quantization_config`, as vLLM's loaders read them, and checked (`packed_checks.py`)
before the model is built on them. The layers' modules are `quant/packed_modules.py`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from offload.errors import ModelError
from offload.memory.safetensors import StoredTensor
from offload.model.packed_checks import (
    check_layer,
    check_method_settings,
    check_targets,
    check_values,
)
from offload.quant.kinds import PackedKind, PackedMethod
from offload.quant.packed_modules import Form, method_of
from offload.quant.packed_quant import dequantize_packed, used_tensors

_CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
_FP8 = (torch.float8_e4m3fn,)


def packed_forms(
    model: nn.Module, settings: Mapping[str, Any], stored: Mapping[str, StoredTensor], where: object
) -> dict[str, Form]:
    """The form of each of `model`'s linear layers that the checkpoint's tensors `stored`
    hold quantized by `settings` (checked against the layer's size)."""
    method = method_of(settings)
    _check_settings(method, settings, where)
    check_method_settings(method, settings, where)
    if method == PackedMethod.COMPRESSED_TENSORS:
        check_targets(settings, model, where)
    prefix = getattr(model, "base_model_prefix", "")
    forms: dict[str, Form] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        tensors = _tensors_of(name, prefix, stored)
        form = _form(method, settings, tensors, module, f"{where}: {name}")
        if form is None:
            continue
        specs = {suffix: (entry.shape, entry.dtype) for suffix, entry in tensors.items()}
        check_layer(form, settings, tensors, module, f"{where}: {name}")
        _check_shapes(form, specs, module, f"{where}: {name}")
        check_values(form, tensors, module, f"{where}: {name}")
        forms[name] = (form, specs)
    if not forms:
        raise ModelError(f"{where}: quant_method {method}, but no layer's tensors are quantized")
    return forms


def _tensors_of(
    name: str, prefix: str, stored: Mapping[str, StoredTensor]
) -> dict[str, StoredTensor]:
    """The checkpoint's tensors of layer `name` by their last name part (a checkpoint of the
    base model alone names them without the base model's prefix)."""
    for stem in (name, name.removeprefix(f"{prefix}.") if prefix else name):
        found = {
            key[len(stem) + 1 :]: entry
            for key, entry in stored.items()
            if key.startswith(f"{stem}.") and "." not in key[len(stem) + 1 :]
        }
        if found:
            return found
    return {}


def _check_settings(
    method: PackedMethod | None, settings: Mapping[str, Any], where: object
) -> None:
    if method == PackedMethod.COMPRESSED_TENSORS:
        formats = {settings.get("format")} | {
            group.get("format")
            for group in (settings.get("config_groups") or {}).values()
            if isinstance(group, dict)
        }
        unread = sorted(str(f) for f in formats - {None, "dense", *_CT_FORMATS})
        if unread:
            raise ModelError(
                f"{where}: compressed-tensors format {unread[0]} is not read "
                f"(read: {', '.join(_CT_FORMATS)})"
            )
    bits = settings.get("bits")
    if method == PackedMethod.GPTQ and (bits not in (2, 4, 8) or not isinstance(bits, int)):
        raise ModelError(f"{where}: GPTQ bits {settings.get('bits')!r} is not read (read: 2, 4, 8)")
    if method == PackedMethod.AWQ:
        version = str(settings.get("version", "gemm")).lower()
        if (
            version != "gemm"
            or settings.get("bits", 4) != 4
            or not settings.get("zero_point", True)
        ):
            raise ModelError(
                f"{where}: AWQ version {version}, {settings.get('bits', 4)} bits, zero_point "
                f"{settings.get('zero_point', True)} is not read (read: GEMM, 4 bits, zero points)"
            )


def _form(
    method: PackedMethod | None,
    settings: Mapping[str, Any],
    tensors: Mapping[str, StoredTensor],
    module: nn.Linear,
    where: str,
) -> str | None:
    """The form of one layer's tensors, or None for a layer stored unquantized."""
    dtype = tensors["weight"].dtype if "weight" in tensors else None
    if method == PackedMethod.COMPRESSED_TENSORS:
        if "weight_g_idx" in tensors:
            raise ModelError(
                f"{where} is quantized with activation order (weight_g_idx), which is not read yet"
            )
        if "weight_packed" in tensors:
            return f"{PackedKind.CT_PACKED}:{_packed_bits(tensors['weight_packed'], module, where)}"
        block = _ct_block(settings)
        if "weight_scale" in tensors and dtype in _FP8 and block:
            return _fp8_form(block, tensors)
        if "weight_scale" in tensors and dtype in (torch.int8, *_FP8):
            return PackedKind.CT_PLAIN.value  # (a plain string: see `kinds.py`)
        return None
    if method in (PackedMethod.GPTQ, PackedMethod.AWQ):
        if "qweight" not in tensors:
            return None
        if method == PackedMethod.AWQ:
            return PackedKind.AWQ.value
        version = "v2" if settings.get("checkpoint_format") == "gptq_v2" else "v1"
        # act-order groups by g_idx; without it vLLM ignores g_idx too (groups in order)
        act = ":act" if settings.get("desc_act") and "g_idx" in tensors else ""
        return f"{PackedKind.GPTQ}:{settings['bits']}:{version}{act}"
    if method == PackedMethod.FP8 and dtype in _FP8:
        return _fp8_form(settings.get("weight_block_size"), tensors)
    return None


def _fp8_form(block: object, tensors: Mapping[str, StoredTensor]) -> str:
    """ "fp8:rows:columns" for a scale per block of the size the settings name, else "fp8"
    (one scale, one a row or one a group of inputs, as the scale's shape says)."""
    scale = tensors.get("weight_scale_inv", tensors.get("weight_scale"))
    if scale is not None and len(scale.shape) == 2 and isinstance(block, list) and len(block) == 2:
        return f"{PackedKind.FP8}:{block[0]}:{block[1]}"
    return PackedKind.FP8.value


def _ct_block(settings: Mapping[str, Any]) -> list[int] | None:
    for group in (settings.get("config_groups") or {}).values():
        weights = group.get("weights") if isinstance(group, dict) else None
        if isinstance(weights, dict) and weights.get("strategy") == "block":
            return weights.get("block_structure")
    return None


def _packed_bits(packed: StoredTensor, module: nn.Linear, where: str) -> int:
    """The bits a value of a `weight_packed` [out, words] of int32 (4 or 8)."""
    words = packed.shape[-1] if packed.shape else 0
    bits = words * 32 // module.in_features
    if (
        packed.dtype != torch.int32
        or len(packed.shape) != 2
        or bits not in (4, 8)
        or words * 32 != module.in_features * bits
    ):
        raise ModelError(
            f"{where}.weight_packed ({packed.dtype}, {list(packed.shape)}) is not "
            f"{module.in_features} inputs of 4 or 8 bits a value packed in int32 words"
        )
    return bits


def _check_shapes(form: str, specs: dict, module: nn.Linear, where: str) -> None:
    """The layer's tensors de-quantize to its [out, in] weight (run on the meta device), else
    a ModelError that names them."""
    metas = [
        torch.empty(shape, dtype=dtype, device="meta")
        for shape, dtype in (specs[name] for name in used_tensors(form, specs))
    ]
    try:
        shape = tuple(dequantize_packed(form, metas).shape)
    except (RuntimeError, ValueError, IndexError):
        shape = None
    if shape != (module.out_features, module.in_features):
        held = ", ".join(f"{name} {list(s)}" for name, (s, _) in specs.items())
        raise ModelError(
            f"{where} ({held}) does not hold a {module.out_features}x{module.in_features} "
            f"weight as {form.split(':')[0]}"
        )
