"""What a GGUF weight kept in each layout is, in one table (`LAYOUTS`): the tensors its
module holds besides `weight`, how they are made from the file's blocks, the modules a
linear layer and an embedding become, the product that reads them, and the int4 packing
a converted folder names. The packed formats' table is `packed_quant.PACKED` (beside the
de-quantization that reads it)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from offload.quant.gguf_quants import FORMATS
from offload.quant.kinds import QuantLayout
from offload.quant.layouts import (
    CPU_PACKING,
    CUDA_PACKING,
    Packing,
    as_stored,
    int4_cpu_tensors,
    int4_cuda_tensors,
    pack_q8,
    q4_tensors,
)
from offload.quant.quantized import (
    GGUFEmbedding,
    GGUFLinear,
    Int4CudaLinear,
    Int4Linear,
    Q4Linear,
    Q8Embedding,
    Q8Linear,
)


@dataclass(frozen=True)
class LayoutTraits:
    """One layout: `tensors`, its module's stored tensors after `weight` by their parameter
    names, in the product's order (one may be None: q8's offsets); `lay_out`, a weight's
    rows (uint8 [rows, bytes]) and GGUF type -> (weight, *tensors); `linear` and
    `embedding`, the modules an `nn.Linear` and an `nn.Embedding` become (None: a table's
    rows cannot be looked up in it); `product`, the name `kernels.stored_op` knows its
    product by, which takes the GGUF type and a bias after the tensors where `takes_kind`;
    `packing`, the int4 packing whose name a folder in it must carry."""

    tensors: tuple[str, ...]
    lay_out: Callable[[torch.Tensor, str], tuple[torch.Tensor | None, ...]]
    linear: type[nn.Module]
    embedding: type[nn.Module] | None
    product: str
    takes_kind: bool = False
    packing: Packing | None = None


LAYOUTS: dict[QuantLayout, LayoutTraits] = {
    QuantLayout.Q4: LayoutTraits(("scales", "offsets"), q4_tensors, Q4Linear, None, "q4"),
    QuantLayout.INT4: LayoutTraits(
        ("scale_zero",), int4_cpu_tensors, Int4Linear, None, "int4", packing=CPU_PACKING
    ),
    QuantLayout.INT4_CUDA: LayoutTraits(
        ("scale_zero",), int4_cuda_tensors, Int4CudaLinear, None, "int4_cuda", packing=CUDA_PACKING
    ),
    QuantLayout.Q8: LayoutTraits(("scales", "offsets"), pack_q8, Q8Linear, Q8Embedding, "q8"),
    QuantLayout.GGUF: LayoutTraits((), as_stored, GGUFLinear, GGUFEmbedding, "gguf", True),
}


def _names(name: str, traits: LayoutTraits) -> tuple[str, ...]:
    """The names of a weight's tensors: `name`, then its module's others beside it."""
    stem = name.removesuffix(".weight")
    return (name, *(f"{stem}.{tensor}" for tensor in traits.tensors))


def laid_out(name: str, raw: torch.Tensor, kind: str, layout: str) -> dict[str, torch.Tensor]:
    """The tensors of one GGUF weight (uint8 [rows, bytes]) in `layout`, by the names of
    the module's parameters: `weight`, and `scale_zero` or `scales` (and `offsets`)."""
    traits = LAYOUTS[QuantLayout(layout)]
    made = traits.lay_out(raw, kind)
    return {key: t for key, t in zip(_names(name, traits), made, strict=True) if t is not None}


def stored_entries(
    name: str, kind: str, shape: Sequence[int], layout: str
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The tensors (name, dtype, shape) that `laid_out` makes of the weight `name` of GGUF
    type `kind` stored as `shape` [rows, bytes per row], in `layout`: its module's
    parameters, made on the meta device."""
    rows, row_bytes = shape
    block = FORMATS[kind]
    values = row_bytes // block.block_bytes * block.block_size
    traits = LAYOUTS[QuantLayout(layout)]
    module = traits.linear(nn.Linear(values, rows, bias=False, device="meta"), kind)
    held = [module.weight, *(getattr(module, tensor) for tensor in traits.tensors)]
    return [
        (key, t.dtype, tuple(t.shape))
        for key, t in zip(_names(name, traits), held, strict=True)
        if t is not None
    ]


def product_args(
    name: str, tensors: Mapping[str, torch.Tensor], kind: str, layout: str
) -> tuple[str, tuple[object, ...]]:
    """The product of the weight `name` laid out in `layout` (`tensors`: `laid_out`'s) as
    `kernels.stored_op` takes it: its name and the arguments after the input."""
    traits = LAYOUTS[QuantLayout(layout)]
    weight, *others = _names(name, traits)
    args = (tensors[weight], *(tensors.get(key) for key in others))
    return traits.product, (*args, kind, None) if traits.takes_kind else args


def stored_settings(types: dict[str, str], layouts: dict[str, str]) -> dict[str, object]:
    """The `quantization_config` of weights of GGUF `types` kept in `layouts` (each
    packing named by the fingerprint of the torch and device that made it)."""
    settings: dict[str, object] = {"quant_method": "gguf", "weight_types": types}
    if layouts:
        settings["weight_layouts"] = layouts
    for layout, traits in LAYOUTS.items():
        if traits.packing is not None and layout in layouts.values():
            settings[traits.packing.settings_key] = traits.packing.here()
    return settings
