"""Which compute devices offloading runs on, checked before anything is allocated."""

from __future__ import annotations

import torch

from offload.errors import ConfigError


def check_device(device: torch.device | str) -> torch.device:
    """`device` as a `torch.device`, refused with one clear line unless it is the CPU or
    a CUDA device this process can use."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {str(device)!r}")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device {str(device)!r} is not available: this torch build or machine has no "
            "usable CUDA GPU; use device='cpu'"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ConfigError(f"device {str(device)!r} does not exist: this machine has {count} GPU(s)")
    return device
