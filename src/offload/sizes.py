"""Byte counts in messages: the binary units and one way to write a size for people."""

from __future__ import annotations

from torch import nn

GIB = 2**30
MIB = 2**20
KIB = 2**10


def format_bytes(num_bytes: float) -> str:
    """`num_bytes` in the largest binary unit it reaches, to one decimal ("81.0 MiB");
    below a KiB, whole bytes ("512 B")."""
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes:.0f} B"


def parameter_bytes(module: nn.Module) -> int:
    """The bytes of `module`'s parameters (each shared parameter once)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def compute_dtype(model: nn.Module):
    """The dtype `model` computes (and keeps its KV cache) in: that of its first
    floating-point parameter outside the modules that hold quantized weights as stored
    (those say so with `holds_stored_weights`: their bytes and scales are not it)."""
    for module in model.modules():
        if getattr(module, "holds_stored_weights", False):
            continue
        for parameter in module.parameters(recurse=False):
            if parameter.dtype.is_floating_point:
                return parameter.dtype
    return next(model.parameters()).dtype
