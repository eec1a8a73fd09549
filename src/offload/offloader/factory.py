"""The factory: the offloader a config selects (vLLM's `create_offloader`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from offload.config import Backend, OffloadConfig
from offload.errors import ConfigError
from offload.memory.copy_engine import CopyEngine, make_copy_engine
from offload.memory.disk_layout import TensorRange
from offload.memory.placement import AUTO
from offload.offloader.base import BaseOffloader, NoopOffloader
from offload.offloader.disk_tier import DiskSettings, DiskTier, ReadHooks
from offload.offloader.prefetch import PrefetchOffloader
from offload.offloader.uva import UVAOffloader
from offload.sizes import GIB


def create_offloader(
    config: OffloadConfig | Mapping[str, Any] | None,
    device: torch.device | str | None = None,
    *,
    checkpoint: Mapping[str, TensorRange] | None = None,
    copy_engine_factory: Callable[[torch.device], CopyEngine] | None = None,
    read_hooks: ReadHooks | None = None,
    stack_budget_bytes: int | None = None,
) -> BaseOffloader:
    """Build the offloader `config` selects (vLLM's rule for `offload_backend="auto"`).

    `device` is the compute device; when None, each wrapped module's own device is used.
    `checkpoint` (for a disk tier) gives each parameter's bytes in the model's files.
    `copy_engine_factory` (device -> CopyEngine) makes the engine the prefetch backend
    copies layers with, in place of the library's choice: a hook for tests and custom
    engines. Other backends ignore it. `read_hooks`: the disk tier's switches for tests.
    `stack_budget_bytes` (with a disk tier): all the RAM the layer stack may take, its
    slots and touched pages of mapped files included (`LLM`'s process budget on a CPU), in
    place of `cpu_memory_gb` bounding the layers kept in host memory alone.
    """
    config = as_config(config)
    device = torch.device(device) if device is not None else None
    backend = config.selected_backend
    if backend == Backend.UVA:
        if config.uva.cpu_offload_gb == AUTO:
            raise ConfigError(
                "cpu_offload_gb='auto' needs the model's size and the device budget: "
                "use LLM(...) or 'offload generate', or give a number of GiB"
            )
        return UVAOffloader(
            cpu_offload_max_bytes=int(config.uva.cpu_offload_gb * GIB),
            cpu_offload_params=config.uva.cpu_offload_params,
            device=device,
            disable_uva=config.disable_uva,
            disable_pin_memory=config.disable_pin_memory,
        )
    if backend == Backend.PREFETCH:
        pre = config.prefetch
        group, num, step = (
            pre.offload_group_size,
            pre.offload_num_in_group,
            pre.offload_prefetch_step,
        )
        if group == 0:  # a disk tier with no layout given: every layer, as vLLM would
            group, num, step = 1, 1, max(step, 2)
        return PrefetchOffloader(
            group_size=group,
            num_in_group=num,
            prefetch_step=step,
            offload_params=pre.offload_params,
            device=device,
            disable_pin_memory=config.disable_pin_memory,
            unit=config.prefetch_unit,
            disk=(
                _disk_tier(config, checkpoint, read_hooks, stack_budget_bytes)
                if config.disk.is_active
                else None
            ),
            copy_engine_factory=copy_engine_factory or make_copy_engine,
        )
    return NoopOffloader()


def _disk_tier(
    config: OffloadConfig,
    checkpoint: Mapping[str, TensorRange] | None,
    hooks: ReadHooks | None,
    stack_budget_bytes: int | None,
) -> DiskTier:
    if not checkpoint:
        raise ConfigError(
            "cpu_memory_gb (the disk tier) streams layers from the model's own safetensors "
            "files: load the model with LLM(...) or load_model(), or pass the checkpoint "
            "folder to offload.apply(..., checkpoint=)"
        )
    disk = config.disk
    settings = DiskSettings(
        ranges=checkpoint,
        budget_bytes=(
            int(disk.cpu_memory_gb * GIB) if stack_budget_bytes is None else stack_budget_bytes
        ),
        read_ahead=disk.read_ahead,
        io=disk.disk_io,
        num_threads=disk.io_threads,
        whole_stack=stack_budget_bytes is not None,
    )
    return DiskTier(settings, hooks or ReadHooks())


def as_config(config: OffloadConfig | Mapping[str, Any] | None) -> OffloadConfig:
    """Accept a config (as it is: frozen, it was checked when made), a dict in vLLM's
    shape, or None (no offloading)."""
    if config is None:
        return OffloadConfig()
    if isinstance(config, OffloadConfig):
        return config
    if isinstance(config, Mapping):
        return OffloadConfig.from_dict(config)
    raise ConfigError(f"config must be an OffloadConfig or a dict, got {type(config).__name__}")
