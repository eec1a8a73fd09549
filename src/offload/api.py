"""`offload.apply`: offload any built model in one call."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offload.config import Backend, OffloadConfig
from offload.errors import ModelError
from offload.memory.copy_engine import CopyEngine
from offload.memory.device import check_device, cuda_usable
from offload.memory.disk_layout import TensorRange
from offload.offloader.base import BaseOffloader, NoopOffloader, set_offloader
from offload.offloader.disk_ranges import checkpoint_ranges
from offload.offloader.disk_tier import ReadHooks
from offload.offloader.factory import as_config, create_offloader
from offload.offloader.layers import find_layers, resolve_layers
from offload.offloader.manifest import OffloadedParam, offloaded_params, set_param_data


def apply(
    model: nn.Module,
    config: OffloadConfig | Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
    *,
    layers: str | nn.Module | Iterable[nn.Module] | None = None,
    checkpoint: str | Path | Mapping[str, TensorRange] | None = None,
    copy_engine_factory: Callable[[torch.device], CopyEngine] | None = None,
) -> BaseOffloader:
    """Offload `model`'s weights as `config` says; return the offloader.

    Finds the model's repeated layer stack (or takes `layers`: a module name, a
    ModuleList, or modules), wraps it with the configured backend, puts every other
    parameter and buffer on `device` (default: where the model is, not "auto": a model
    on the CPU computes on the CPU, with a warning if a GPU is usable), runs `post_init`
    and makes the offloader the process-wide one (`get_offloader()`). Offloaded
    weights go straight from where they are to host memory, layer by layer, so the
    device never holds more than the resident part of the model.

    With a disk tier (`cpu_memory_gb`), the layers beyond that host budget are read from
    the model's safetensors files each forward: `checkpoint` names their folder (default:
    the folder `from_pretrained` loaded it from).

    `copy_engine_factory` (device -> CopyEngine), for the prefetch backend, makes the engine
    that copies layers in place of the library's choice: a hook for tests and custom engines
    (other backends ignore it).
    """
    if not isinstance(model, nn.Module):
        raise ModelError(f"apply needs a torch.nn.Module, got {type(model).__name__}")
    _check_no_meta(model)
    device = check_device(device if device is not None else _model_device(model))
    offloader = prepare(
        model,
        config,
        device,
        layers,
        checkpoint=checkpoint,
        copy_engine_factory=copy_engine_factory,
    )
    if device.type == "cpu" and offloader.offloaded_bytes and cuda_usable():
        warnings.warn(
            "offload.apply: the model computes on the CPU, the same memory its weights are "
            "offloaded to, while a GPU is usable; pass device='cuda' to compute there",
            UserWarning,
            stacklevel=2,
        )
    return finish(offloader)


def prepare(
    model: nn.Module,
    config: OffloadConfig | Mapping[str, Any] | None,
    device: torch.device,
    layers: str | nn.Module | Iterable[nn.Module] | None = None,
    *,
    deferred: bool = False,
    checkpoint: str | Path | Mapping[str, TensorRange] | None = None,
    copy_engine_factory: Callable[[torch.device], CopyEngine] | None = None,
    read_hooks: ReadHooks | None = None,
    stack_budget_bytes: int | None = None,
    planned: OffloadPlan | None = None,
) -> BaseOffloader:
    """Everything `apply` does before `post_init`. With `deferred`, parameters may still
    be on the meta device: offloaded ones get their host memory, resident ones empty
    device memory, and a loader then reads the checkpoint into them. If anything fails,
    what was done is undone: the model is left as it was. `copy_engine_factory`: as for
    `apply` (a hook for tests and custom engines); `read_hooks`: the disk tier's switches
    for tests; `stack_budget_bytes`: all the RAM the disk tier's layer stack may take
    (a process budget, see `create_offloader`). `planned`: a dry run of `model` (`plan`)
    whose offloader is the one to use, as it was made (no second one is built; the
    arguments that make an offloader are then not taken)."""
    if planned is None:  # (the usual way: one offloader, made here)
        offloader, blocks = _offloader_for(
            model,
            config,
            device,
            layers,
            checkpoint,
            copy_engine_factory,
            read_hooks,
            stack_budget_bytes,
        )
    else:
        made = (checkpoint, copy_engine_factory, read_hooks, stack_budget_bytes)
        offloader, blocks = _planned_offloader(model, planned, layers, made)
    try:
        offloader.wrap_modules(iter(blocks), deferred=deferred)
    except BaseException:
        offloader.ledger.undo(offloader.restore)
        raise
    _move_resident(model, offloader, device)
    offloader.serialize_forwards(model)
    return offloader


@dataclass(frozen=True)
class OffloadPlan:
    """What `apply` would do to a model, decided without touching it (a dry run), and the
    offloader that would do it: `prepare(model, ..., planned=plan)` carries it out."""

    offloader: BaseOffloader  # planned, not wrapped (for prefetch: `unit`, `prefetch_step`)
    params: list[OffloadedParam]  # the parameters it would move, in order
    model: nn.Module | None = None  # the model planned for
    blocks: tuple[nn.Module, ...] | None = None  # the layers to wrap (None: none looked for)

    @property
    def offloaded_bytes(self) -> int:
        return sum(entry.num_bytes for entry in self.params)

    @property
    def staging_bytes(self) -> int:
        """Device memory the offloader needs beside the resident weights."""
        return self.offloader.planned_staging_bytes


def plan(
    model: nn.Module,
    config: OffloadConfig | Mapping[str, Any] | None,
    device: torch.device,
    layers: str | nn.Module | Iterable[nn.Module] | None = None,
    checkpoint: str | Path | Mapping[str, TensorRange] | None = None,
) -> OffloadPlan:
    """The plan `prepare` would carry out, and nothing else: no memory is allocated and
    no hook attached, so `model` may be built on the meta device. A config that offloads
    nothing plans nothing (no layer stack is looked for)."""
    config = as_config(config)
    if config.selected_backend == Backend.NONE:
        return OffloadPlan(NoopOffloader(), [], model)
    offloader, blocks = _offloader_for(model, config, device, layers, checkpoint)
    return OffloadPlan(offloader, offloader.plan(iter(blocks)), model, tuple(blocks))


def _planned_offloader(
    model: nn.Module,
    planned: OffloadPlan,
    layers: str | nn.Module | Iterable[nn.Module] | None,
    made: tuple,
) -> tuple[BaseOffloader, list[nn.Module]]:
    """`planned`'s offloader, as it was made, and the layers it wraps: the plan's, or
    (where it offloads nothing and looked for none) found as `prepare` finds them."""
    if planned.model is not model:
        raise ModelError("prepare(planned=...) carries out a plan on the model it was made for")
    if any(argument is not None for argument in made) or (
        layers is not None and planned.blocks is not None
    ):
        raise ModelError(
            "prepare(planned=...) uses the plan's offloader and layers as they were made: "
            "pass layers, checkpoint, copy_engine_factory, read_hooks and "
            "stack_budget_bytes to the plan"
        )
    _check_not_offloaded(model)
    if planned.blocks is not None:
        return planned.offloader, list(planned.blocks)
    blocks = resolve_layers(model, layers) if layers is not None else find_layers(model)
    _bind(planned.offloader, model, blocks)
    return planned.offloader, blocks


def _offloader_for(
    model: nn.Module,
    config: OffloadConfig | Mapping[str, Any] | None,
    device: torch.device,
    layers: str | nn.Module | Iterable[nn.Module] | None,
    checkpoint: str | Path | Mapping[str, TensorRange] | None = None,
    copy_engine_factory: Callable[[torch.device], CopyEngine] | None = None,
    read_hooks: ReadHooks | None = None,
    stack_budget_bytes: int | None = None,
) -> tuple[BaseOffloader, list[nn.Module]]:
    """The offloader `config` selects, told the model's names and what must stay
    resident, and the layers it is to wrap."""
    _check_not_offloaded(model)
    blocks = resolve_layers(model, layers) if layers is not None else find_layers(model)
    config = as_config(config)
    ranges = checkpoint_ranges(model, checkpoint) if config.disk.is_active else None
    offloader = create_offloader(
        config,
        device=device,
        checkpoint=ranges,
        copy_engine_factory=copy_engine_factory,
        read_hooks=read_hooks,
        stack_budget_bytes=stack_budget_bytes,
    )
    _bind(offloader, model, blocks)
    return offloader, blocks


def _bind(offloader: BaseOffloader, model: nn.Module, blocks: list[nn.Module]) -> None:
    """Tell `offloader` the model's names and what must stay resident."""
    offloader.ledger.name_modules(model)
    offloader.ledger.keep_resident(_params_outside(model, blocks))
    offloader.ledger.keep_resident(p for p in model.parameters() if _self_overlapping(p))


def _check_not_offloaded(model: nn.Module) -> None:
    taken = offloaded_params(model)
    if taken:
        raise ModelError(
            f"this model is already offloaded ({len(taken)} parameters, first "
            f"{taken[0]!r}); apply offloading once, to a model that is not offloaded"
        )


def finish(offloader: BaseOffloader) -> BaseOffloader:
    """Run `post_init` and make `offloader` the process-wide one (weakly: the model's
    hooks keep it alive, `get_offloader()` does not)."""
    offloader.post_init()
    set_offloader(offloader, weak=True)
    return offloader


def _check_no_meta(model: nn.Module) -> None:
    tensors = [*model.named_parameters(), *model.named_buffers()]
    on_meta = [name for name, tensor in tensors if tensor.is_meta]
    if on_meta:
        raise ModelError(
            f"{len(on_meta)} of the model's tensors are on the meta device (first: "
            f"{on_meta[0]!r}); load real weights (e.g. from_pretrained) before offloading"
        )


def _model_device(model: nn.Module) -> torch.device:
    devices = {t.device for t in (*model.parameters(), *model.buffers())}
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise ModelError(f"the model's tensors are on several devices ({names}); pass device=")
    return devices.pop() if devices else torch.device("cpu")


def _params_outside(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Parameter]:
    """Parameters that modules outside `blocks` also use (weights tied across the
    boundary, or a submodule of a block that the model also holds elsewhere): offloading
    them would move them under the feet of those modules. Every module reachable from
    `model` without entering a block counts as outside."""
    stops = {id(block) for block in blocks}
    seen: set[int] = set()
    outside, pending = [], [model]
    while pending:
        module = pending.pop()
        if id(module) in seen or id(module) in stops:
            continue
        seen.add(id(module))
        outside += module.parameters(recurse=False)
        pending += module.children()
    return outside


def _self_overlapping(param: torch.Tensor) -> bool:
    """A broadcast (stride-0) parameter: several elements share memory, so it cannot be
    packed into a slab; it is small by nature and stays where it is."""
    return any(
        step == 0 and size > 1 for size, step in zip(param.shape, param.stride(), strict=True)
    )


def _move_resident(model: nn.Module, offloader: BaseOffloader, device: torch.device) -> None:
    """Move what stays resident to `device`, one tensor at a time (no second copy of the
    model anywhere); offloaded parameters are left where the offloader put them."""
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if param.device == device or offloader.ledger.is_offloaded(param):
                continue
            if param.is_meta:  # deferred loading: the loader fills it in
                set_param_data(param, torch.empty_like(param, device=device))
            else:
                param.data = param.data.to(device)
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)
