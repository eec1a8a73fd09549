"""The link's rates: host -> device copies (a memory copy on a CPU) and kernels reading
host memory in place (GPU), each a median of a few repeats; and the `Clock` that times
them (and compute) on a device."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from offload.memory.host import device_view


class Clock:
    """Times a callable on `device`: CUDA events on a GPU (no host round trip inside the
    timed span), the wall clock on a CPU."""

    def __init__(self, device: torch.device):
        self.device = device

    def seconds(self, fn: Callable[[], object], warmup: int, repeats: int) -> float:
        """The median of `repeats` timed calls of `fn`, after `warmup` untimed ones."""
        for _ in range(warmup):
            fn()
        return statistics.median(self.once(fn) for _ in range(repeats))

    def once(self, fn: Callable[[], object]) -> float:
        if self.device.type != "cuda":
            started = time.perf_counter()
            fn()
            return time.perf_counter() - started
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        fn()
        end.record()
        end.synchronize()  # the span is over only when the device has run it
        return start.elapsed_time(end) / 1e3


def link_gb_per_s(
    device: torch.device,
    num_bytes: int,
    warmup: int,
    repeats: int,
    *,
    pinned: bool | None = None,
) -> float:
    """Host -> `device` copies of `num_bytes` from pinned memory (pageable where `pinned`
    is False), GB/s; on a CPU, a memory copy (each byte counted once)."""
    pinned = device.type == "cuda" if pinned is None else pinned
    source = torch.ones(num_bytes, dtype=torch.uint8, pin_memory=pinned)
    target = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    seconds = Clock(device).seconds(
        lambda: target.copy_(source, non_blocking=bool(pinned)), warmup, repeats
    )
    return num_bytes / seconds / 1e9


def uva_gb_per_s(device: torch.device, num_bytes: int, warmup: int, repeats: int) -> float:
    """A kernel reading pinned host memory in place through a zero-copy view (GPU), GB/s;
    0 where there is no such view (a CPU reads host memory as its own)."""
    if device.type != "cuda":
        return 0.0
    host = torch.ones(num_bytes // 4, dtype=torch.float32, pin_memory=True)
    try:
        view = device_view(host, device)
    except RuntimeError:  # no zero-copy views here: UVA reads are not an option
        return 0.0
    target = torch.empty_like(view, device=device)
    seconds = Clock(device).seconds(lambda: torch.neg(view, out=target), warmup, repeats)
    return host.numel() * 4 / seconds / 1e9
