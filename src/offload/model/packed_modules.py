"""Linear layers kept as a quantized safetensors checkpoint stores them (compressed-tensors,
GPTQ, AWQ, FP8: `packed_quant.py`), and which layers those are.

A `PackedLinear` holds the file's own tensors under the file's own names (`qweight`,
`weight_packed`, `weight_scale`, ...), so the loader reads them straight into their slabs
and the offloaders and the disk tier move the stored bytes; each forward de-quantizes the
weight into a temporary just before its product. Which layers are quantized, and how, is
read from the checkpoint's tensors (their names, dtypes and shapes) with the method's
settings in `quantization_config`: the file says what it holds, as vLLM's loaders read it.
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
from offload.model.packed_quant import dequantize_packed
from offload.model.quant_layouts import stored_op

METHODS = ("compressed-tensors", "gptq", "awq", "fp8")
ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}  # vLLM's kernel names, same files
FORMS_KEY = "offload_forms"  # (a config cut to a few layers carries its layers' forms)
_CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
_FP8 = (torch.float8_e4m3fn,)

Form = tuple[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]  # (form, tensor -> spec)


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight as the checkpoint stores it in `form`."""

    holds_stored_weights = True  # (`sizes.compute_dtype` looks past them)
    linear_of_floats = True  # (its product is F.linear: `cpu_linear.kernels_for` counts it)

    def __init__(self, linear: nn.Linear, form: str, specs: Mapping[str, Any]):
        super().__init__()
        self.in_features, self.out_features, self.form = (
            linear.in_features,
            linear.out_features,
            form,
        )
        self._used, self.specs = _used(form, specs), dict(specs)
        for name, (shape, dtype) in specs.items():
            if name != "bias":
                empty = torch.empty(shape, dtype=dtype, device="meta")
                self.register_parameter(name, nn.Parameter(empty, requires_grad=False))
        self.bias = linear.bias
        if self.bias is None and "bias" in specs:  # (GPTQ files keep a bias some layers lack)
            empty = torch.empty(specs["bias"][0], dtype=specs["bias"][1], device="meta")
            self.bias = nn.Parameter(empty, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tensors = [getattr(self, name) for name in self._used]
        return stored_op("packed", x, tensors, self.form, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.form}"


def _used(form: str, specs: Mapping[str, Any]) -> list[str]:
    """The tensors `dequantize_packed` takes for `form`, in its order."""
    kind = form.split(":")[0]
    if kind == "ct_packed":
        names = ["weight_packed", "weight_scale", "weight_zero_point"]
    elif kind == "ct_plain":
        names = ["weight", "weight_scale", "weight_zero_point"]
    elif kind == "gptq":
        names = ["qweight", "qzeros", "scales", "g_idx"]
    elif kind == "awq":
        names = ["qweight", "qzeros", "scales"]
    else:
        names = ["weight", "weight_scale_inv" if "weight_scale_inv" in specs else "weight_scale"]
    return [name for name in names if name in specs]


def method_of(settings: Mapping[str, Any]) -> str | None:
    """The packed method a `quantization_config` names (vLLM's aliases folded), or None."""
    method = settings.get("quant_method")
    method = ALIASES.get(method, method) if isinstance(method, str) else None
    return method if method in METHODS else None


def packed_forms(
    model: nn.Module, settings: Mapping[str, Any], stored: Mapping[str, StoredTensor], where: object
) -> dict[str, Form]:
    """The form of each of `model`'s linear layers that the checkpoint's tensors `stored`
    hold quantized by `settings` (checked against the layer's size)."""
    method = method_of(settings)
    _check_settings(method, settings, where)
    check_method_settings(method, settings, where)
    if method == "compressed-tensors":
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


def swap_in_packed(model: nn.Module, forms: Mapping[str, Form]) -> None:
    """Replace each linear layer `forms` names by its `PackedLinear`."""
    for name, (form, specs) in forms.items():
        model.set_submodule(name, PackedLinear(model.get_submodule(name), form, specs))


def forms_of(model: nn.Module) -> dict[str, Form]:
    """The form of each `PackedLinear` of `model`, by its name."""
    return {
        name: (module.form, module.specs)
        for name, module in model.named_modules()
        if isinstance(module, PackedLinear)
    }


def forms_setting(forms: Mapping[str, Form]) -> dict[str, list[Any]]:
    """`forms` as JSON (for a config that carries them: `FORMS_KEY`)."""
    return {
        name: [
            form,
            {
                t: [list(shape), str(dtype).removeprefix("torch.")]
                for t, (shape, dtype) in specs.items()
            },
        ]
        for name, (form, specs) in forms.items()
    }


def forms_from_setting(setting: Mapping[str, Any]) -> dict[str, Form]:
    return {
        name: (
            form,
            {t: (tuple(shape), getattr(torch, dtype)) for t, (shape, dtype) in specs.items()},
        )
        for name, (form, specs) in setting.items()
    }


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


def _check_settings(method: str | None, settings: Mapping[str, Any], where: object) -> None:
    if method == "compressed-tensors":
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
    if method == "gptq" and (bits not in (2, 4, 8) or not isinstance(bits, int)):
        raise ModelError(f"{where}: GPTQ bits {settings.get('bits')!r} is not read (read: 2, 4, 8)")
    if method == "awq":
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
    method: str | None,
    settings: Mapping[str, Any],
    tensors: Mapping[str, StoredTensor],
    module: nn.Linear,
    where: str,
) -> str | None:
    """The form of one layer's tensors, or None for a layer stored unquantized."""
    dtype = tensors["weight"].dtype if "weight" in tensors else None
    if method == "compressed-tensors":
        if "weight_g_idx" in tensors:
            raise ModelError(
                f"{where} is quantized with activation order (weight_g_idx), which is not read yet"
            )
        if "weight_packed" in tensors:
            return f"ct_packed:{_packed_bits(tensors['weight_packed'], module, where)}"
        block = _ct_block(settings)
        if "weight_scale" in tensors and dtype in _FP8 and block:
            return _fp8_form(block, tensors)
        if "weight_scale" in tensors and dtype in (torch.int8, *_FP8):
            return "ct_plain"
        return None
    if method in ("gptq", "awq"):
        if "qweight" not in tensors:
            return None
        if method == "awq":
            return "awq"
        version = "v2" if settings.get("checkpoint_format") == "gptq_v2" else "v1"
        # act-order groups by g_idx; without it vLLM ignores g_idx too (groups in order)
        act = ":act" if settings.get("desc_act") and "g_idx" in tensors else ""
        return f"gptq:{settings['bits']}:{version}{act}"
    if method == "fp8" and dtype in _FP8:
        return _fp8_form(settings.get("weight_block_size"), tensors)
    return None


def _fp8_form(block: object, tensors: Mapping[str, StoredTensor]) -> str:
    """ "fp8:rows:columns" for a scale per block of the size the settings name, else "fp8"
    (one scale, one a row or one a group of inputs, as the scale's shape says)."""
    scale = tensors.get("weight_scale_inv", tensors.get("weight_scale"))
    if scale is not None and len(scale.shape) == 2 and isinstance(block, list) and len(block) == 2:
        return f"fp8:{block[0]}:{block[1]}"
    return "fp8"


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
        for shape, dtype in (specs[name] for name in _used(form, specs))
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
