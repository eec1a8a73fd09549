"""A .gguf's architecture and tensors, from its header alone (`gguf_read.py`), after every
check of `gguf_checks.check_gguf_header`: what the loader asks of a .gguf before anything
else reads it."""

from __future__ import annotations

from pathlib import Path

from offload.model.gguf_checks import check_gguf_header
from offload.model.gguf_read import HeaderTensor

__all__ = ["HeaderTensor", "gguf_header", "gguf_tensors"]


def gguf_header(source: Path) -> tuple[str | None, list[tuple[str, str]]]:
    """A .gguf's architecture and its tensors' (name, type name), after every check of
    `check_gguf_header` (ModelError naming the field otherwise)."""
    arch, tensors = gguf_tensors(source)
    return arch, [(tensor.name, tensor.kind) for tensor in tensors]


def gguf_tensors(source: Path) -> tuple[str | None, list[HeaderTensor]]:
    """A .gguf's architecture and its tensors, as gguf's reader finds them, after every
    check of `check_gguf_header`."""
    header = check_gguf_header(source)
    return header.arch, header.tensors
