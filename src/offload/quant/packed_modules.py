"""Linear layers kept as a quantized safetensors checkpoint stores them (compressed-tensors,
GPTQ, AWQ, FP8: `packed_quant.py`), and their forms as a config carries them.

A `PackedLinear` holds the file's own tensors under the file's own names (`qweight`,
`weight_packed`, `weight_scale`, ...), so the loader reads them straight into their slabs
and the offloaders and the disk tier move the stored bytes; each forward de-quantizes the
weight into a temporary just before its product. Which layers are quantized, and how, is
read from the checkpoint's tensors (`model/packed_forms.py`): the file says what it holds,
as vLLM's loaders read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from offload.quant.kernels import stored_op
from offload.quant.kinds import PackedMethod
from offload.quant.packed_quant import used_tensors

METHODS: tuple[PackedMethod, ...] = tuple(PackedMethod)
ALIASES = {
    "gptq_marlin": PackedMethod.GPTQ,
    "awq_marlin": PackedMethod.AWQ,
}  # vLLM's kernel names, same files
FORMS_KEY = "offload_forms"  # (a config cut to a few layers carries its layers' forms)

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
        self._used, self.specs = used_tensors(form, specs), dict(specs)
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


def method_of(settings: Mapping[str, Any]) -> PackedMethod | None:
    """The packed method a `quantization_config` names (vLLM's aliases folded), or None."""
    method = settings.get("quant_method")
    method = ALIASES.get(method, method) if isinstance(method, str) else None
    return PackedMethod(method) if method in METHODS else None


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
