"""The factory: the offloader a config selects (vLLM's `create_offloader`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from offload.config import OffloadConfig
from offload.errors import ConfigError
from offload.offloader.base import BaseOffloader, NoopOffloader
from offload.offloader.prefetch import PrefetchOffloader
from offload.offloader.uva import UVAOffloader


def create_offloader(
    config: OffloadConfig | Mapping[str, Any] | None,
    device: torch.device | str | None = None,
) -> BaseOffloader:
    """Build the offloader `config` selects (vLLM's rule for `offload_backend="auto"`).

    `device` is the compute device; when None, each wrapped module's own device is used.
    """
    config = as_config(config)
    device = torch.device(device) if device is not None else None
    backend = config.selected_backend
    if backend == "uva":
        if config.uva.cpu_offload_gb == "auto":
            raise ConfigError(
                "cpu_offload_gb='auto' needs the model's size and the device budget: "
                "use LLM(...) or 'offload generate', or give a number of GiB"
            )
        return UVAOffloader(
            cpu_offload_max_bytes=int(config.uva.cpu_offload_gb * 1024**3),
            cpu_offload_params=config.uva.cpu_offload_params,
            device=device,
            disable_uva=config.disable_uva,
            disable_pin_memory=config.disable_pin_memory,
        )
    if backend == "prefetch":
        return PrefetchOffloader(
            group_size=config.prefetch.offload_group_size,
            num_in_group=config.prefetch.offload_num_in_group,
            prefetch_step=config.prefetch.offload_prefetch_step,
            offload_params=config.prefetch.offload_params,
            device=device,
            disable_pin_memory=config.disable_pin_memory,
            unit=config.prefetch_unit,
        )
    return NoopOffloader()


def as_config(config: OffloadConfig | Mapping[str, Any] | None) -> OffloadConfig:
    """Accept a config, a dict in vLLM's shape, or None (no offloading)."""
    if config is None:
        return OffloadConfig()
    if isinstance(config, OffloadConfig):
        config.validate()
        return config
    if isinstance(config, Mapping):
        return OffloadConfig.from_dict(config)
    raise ConfigError(f"config must be an OffloadConfig or a dict, got {type(config).__name__}")
