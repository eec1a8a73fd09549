"""Which compute devices offloading runs on, checked before anything is allocated."""

from __future__ import annotations

import torch

from offload.errors import ConfigError
from offload.memory.placement import AUTO

_ALLOWED = "'cpu', 'cuda' or 'cuda:N', or 'auto' (a GPU when one is usable)"


def cuda_usable() -> bool:
    """A CUDA GPU this process can compute on (a CPU build of torch, or a machine whose
    driver sees no GPU, says no; so does CUDA_VISIBLE_DEVICES="")."""
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def check_device(device: torch.device | str) -> torch.device:
    """`device` as a `torch.device`, refused with one clear line unless it is the CPU or
    a CUDA device this process can use. "auto" is the first GPU when one is usable, else
    the CPU (vLLM users never name the device)."""
    if device == AUTO:
        return torch.device("cuda", 0) if cuda_usable() else torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device must be {_ALLOWED}, got {device!r}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ConfigError(f"device must be {_ALLOWED}, got {str(device)!r}")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device {str(device)!r} is not available: this torch build or machine has no "
            "usable CUDA GPU; use device='cpu' (or 'auto')"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ConfigError(f"device {str(device)!r} does not exist: this machine has {count} GPU(s)")
    return device


def synchronize(device: torch.device) -> None:
    """Waits for `device`'s queued kernels (a GPU's run after their call returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
