"""What each tensor of a .gguf becomes as stored, decided before a byte is laid out: the
order the converted file holds them in, each weight's layout, the tensors that layout
makes (names, dtypes and shapes, so the file's header and size are known ahead), and
which tensors are not copied at all.

A tensor is *referenced* (the converted folder names its byte range in the .gguf, and
the loader and the disk tier read it there) where its bytes are used as they are: a
weight kept in GGUF's own blocks, and a float tensor of a layer (or of the rest of the
model) whose weights are all referenced (so such a layer is one run of the .gguf). Llama's
query and key rows in llama.cpp's rotary order stay referenced too: their module puts the
rows back in transformers' order at each product (`quantized.GGUFLinear`), a copy of
their blocks being 12-17% of a Llama's layers. Everything else is copied, in the order
the forward runs (layer 0, 1, ...; within a layer as it uses them), so that a layer's
copied tensors are one run of the converted file.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from offload.quant.kinds import QuantLayout
from offload.quant.traits import stored_entries

FLOATS = {"F32": torch.float32, "F16": torch.float16}
# Within a layer, the order its forward uses its tensors (by the part after the index).
_LAYER_ORDER = (
    "input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
    "self_attn.q_norm", "self_attn.k_norm", "self_attn.o_proj", "post_attention_layernorm",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip
_OUTSIDE_ORDER = ("model.embed_tokens", "model.norm", "lm_head")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of the .gguf: where its bytes are, and what the model calls it."""

    name: str  # transformers' name
    kind: str  # GGUF type name ("Q4_0", "F32", ...)
    shape: tuple[int, ...]  # as stored: [rows, bytes per row] for blocks, else the values'
    offset: int  # absolute, in the .gguf
    num_bytes: int
    heads: int = 0  # >0: its rows are in llama.cpp's rotary order, for this many heads

    @property
    def is_float(self) -> bool:
        return self.kind in FLOATS


@dataclass
class Planned:
    """A tensor's fate: its layout (None for a float tensor), whether it is referenced,
    and the tensors it becomes in the converted folder, in order."""

    source: SourceTensor
    layout: QuantLayout | None
    referenced: bool = False
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = field(default_factory=list)


def forward_order(name: str) -> tuple:
    """A sort key putting transformers' names in the order a forward uses them."""
    found = _LAYER.match(name)
    if found is None:
        stem = name.rsplit(".", 1)[0]
        rank = _OUTSIDE_ORDER.index(stem) if stem in _OUTSIDE_ORDER else len(_OUTSIDE_ORDER)
        return (0 if rank == 0 else 2, 0, rank, name)
    index, part, suffix = int(found.group(1)), found.group(2), found.group(3)
    rank = _LAYER_ORDER.index(part) if part in _LAYER_ORDER else len(_LAYER_ORDER)
    return (1, index, rank, suffix != "weight", name)


def group_of(name: str) -> str:
    """The layer a tensor is in ("model.layers.3"), or "" outside the layer stack."""
    found = _LAYER.match(name)
    return f"model.layers.{found.group(1)}" if found else ""


def plan(
    sources: Sequence[SourceTensor], choose: Callable[[SourceTensor], QuantLayout]
) -> list[Planned]:
    """Each of `sources` (any order) planned, in the order the forward uses them: its
    layout by `choose` (quantized ones), whether it is referenced (see the module's
    docstring) and what it becomes."""
    ordered = sorted(sources, key=lambda source: forward_order(source.name))
    planned = [Planned(s, None if s.is_float else choose(s)) for s in ordered]
    copied_groups = {
        group_of(p.source.name) for p in planned if p.layout not in (None, QuantLayout.GGUF)
    }
    copied_groups |= {
        group_of(p.source.name) for p in planned if p.source.heads and p.layout is None
    }
    for item in planned:
        source = item.source
        if item.layout is None:
            item.referenced = not source.heads and group_of(source.name) not in copied_groups
            item.entries = [(source.name, FLOATS[source.kind], source.shape)]
        else:
            item.referenced = item.layout == QuantLayout.GGUF
            item.entries = stored_entries(source.name, source.kind, source.shape, item.layout)
    return planned


def row_orders(planned: Sequence[Planned]) -> dict[str, int]:
    """The referenced weights whose rows are in llama.cpp's rotary order: heads of each
    (the module puts them back in transformers' order)."""
    return {p.source.name: p.source.heads for p in planned if p.referenced and p.source.heads}
