"""Where each parameter's bytes lie in the checkpoint's safetensors files, and the reads
that bring a unit's parameters from them (`disk_layout`), or None where they cannot be read
as they are."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from torch import nn

from offload.errors import ModelError
from offload.memory.disk_layout import DiskLayout, TensorRange, plan_layout
from offload.memory.safetensors import checkpoint_tensors


def checkpoint_ranges(
    model: nn.Module, checkpoint: str | Path | Mapping[str, TensorRange] | None
) -> Mapping[str, TensorRange]:
    """Each of `model`'s parameters' bytes in its safetensors files: `checkpoint` as
    given, or read from the headers in its folder (default: where `from_pretrained`
    loaded `model` from). A key is matched to the model's name as it is, or with the
    base model's prefix (a checkpoint of the base model alone)."""
    if isinstance(checkpoint, Mapping):
        return checkpoint
    folder = Path(checkpoint) if checkpoint is not None else _own_folder(model)
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    prefix = getattr(model, "base_model_prefix", "")
    ranges = {}
    for key, stored in checkpoint_tensors(folder).items():
        name = key if key in names or not prefix else f"{prefix}.{key}"
        ranges[name] = TensorRange(stored.path, stored.offset, stored.num_bytes, stored.dtype)
    return ranges


def _own_folder(model: nn.Module) -> Path:
    source = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if source and Path(source).is_dir():
        return Path(source)
    raise ModelError(
        "cpu_memory_gb (the disk tier) streams layers from the model's safetensors files, "
        f"and the model does not say where they are (its name_or_path is {source!r}): "
        "pass the folder as offload.apply(..., checkpoint=)"
    )


def disk_layout(
    ranges: Mapping[str, TensorRange], params: Sequence[tuple[str, nn.Parameter]]
) -> DiskLayout | None:
    """The reads that bring a unit's parameters (qualified names) from the checkpoint, or
    None when one of them cannot be read as it is: not in the checkpoint, stored in
    another dtype or size, non-contiguous, or at an offset its dtype cannot view."""
    found = []
    for name, param in params:
        stored = ranges.get(name)
        if stored is None or not (param.is_meta or param.is_contiguous()):
            return None
        if stored.dtype not in (None, param.dtype):
            return None
        if stored.num_bytes != param.numel() * param.element_size():
            return None
        if stored.offset % param.element_size():
            return None
        found.append(stored)
    return plan_layout(found)
