"""The parameters an offloader takes: one `OffloadedParam` entry each (the manifest), how
a parameter is pointed at new data, and the checks and names around them."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from offload.errors import ModelError
from offload.memory.placement import Placement
from offload.offloader.selection import unmatched_segments


@dataclass(frozen=True)
class OffloadedParam:
    """One entry of an offloader's manifest: a parameter it moved off the device."""

    name: str  # qualified name in the model, e.g. "model.layers.3.mlp.up_proj.weight"
    module: str  # the wrapped module it belongs to, e.g. "model.layers.3"
    num_bytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    location: Placement  # now: HOST_PINNED or HOST (a host slab), or DISK (its file)
    access: str  # how compute reaches them: "zero-copy", "copy-per-forward" or "prefetch"

    @staticmethod
    def location_of(pinned: bool) -> Placement:
        return Placement.HOST_PINNED if pinned else Placement.HOST

    @classmethod
    def of(
        cls, module: str, name: str, tensor: torch.Tensor, location: Placement, access: str
    ) -> OffloadedParam:
        return cls(
            name=f"{module}.{name}",
            module=module,
            num_bytes=tensor.numel() * tensor.element_size(),
            shape=tuple(tensor.shape),
            dtype=tensor.dtype,
            location=location,
            access=access,
        )


def set_param_data(param: nn.Parameter, data: torch.Tensor) -> None:
    """Point `param` at `data`, keeping the Parameter object (ties and references
    survive). A meta parameter is swapped whole: its data cannot be set across types."""
    if param.is_meta and not data.is_meta:
        torch.utils.swap_tensors(param, nn.Parameter(data, requires_grad=param.requires_grad))
    else:
        param.data = data


def check_not_meta(named: Iterable[tuple[str, nn.Parameter]], where: str, advice: str = "") -> None:
    """Refuse parameters still on the meta device (unless loading is deferred, when a
    loader fills them in)."""
    for name, param in named:
        if param.is_meta:
            raise ModelError(f"parameter {name!r} of {where} is on the meta device{advice}")


def warn_unmatched_segments(option: str, names: list[str], segments: set[str]) -> set[str]:
    """The `segments` of `option` that match none of `names`; a warning names them when
    the others are used."""
    missing = unmatched_segments(names, segments)
    if missing and len(missing) < len(segments):
        warnings.warn(
            f"{option} {sorted(missing)} match no parameter; the others are used",
            UserWarning,
            stacklevel=4,
        )
    return missing


def offloaded_params(model: nn.Module) -> list[str]:
    """Names of `model`'s parameters that an offloader has already taken."""
    return [
        name
        for name, p in model.named_parameters(remove_duplicate=False)
        if getattr(p, "_offload_taken", False)
    ]
