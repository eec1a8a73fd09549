"""The machine's limits, measured in the same run as the methods: host memory copy, the
disk's sequential `O_DIRECT` read and reads from the page cache over the checkpoint's own
files, and on a GPU host-to-device copies from pinned and from pageable memory."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from offload.bench.host_io import (
    cached_file_bytes,
    cached_read_gb_per_s,
    direct_read_gb_per_s,
    meminfo_bytes,
    warm_file_cache,
)
from offload.bench.machine import median_seconds
from offload.config import OffloadConfig

COPY_BYTES = 256 * 2**20  # large enough to leave the CPU caches far behind
READ_BYTES = 2**30  # at most this much of the checkpoint is read per way of reading
_DISK_READ_BYTES = 4 * 2**20  # the size of the disk tier's reads


@dataclass
class Limits:
    """Bandwidths in GB/s (1e9 bytes; None: not measured here, see `notes`) and the
    memory the machine has, for a planner to weigh the methods' figures against."""

    memcpy_gb_per_s: float
    disk_read_gb_per_s: float | None = None
    page_cache_read_gb_per_s: float | None = None
    h2d_pinned_gb_per_s: float | None = None
    h2d_pageable_gb_per_s: float | None = None
    host_memory_bytes: int = 0
    host_available_bytes: int = 0
    device_memory_bytes: int | None = None
    device_free_bytes: int | None = None
    # Each way of reading the disk, every time it was measured (before each round: a
    # virtual disk's speed drifts); the bound takes the faster way's median.
    disk_read_ways_gb_per_s: dict[str, list[float]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def link_gb_per_s(self) -> dict[str, float | None]:
        """The bandwidth of each link in `bound.LINKS`."""
        return {
            "memcpy": self.memcpy_gb_per_s,
            "disk": self.disk_read_gb_per_s,
            "page_cache": self.page_cache_read_gb_per_s,
            "h2d_pinned": self.h2d_pinned_gb_per_s,
            "h2d_pageable": self.h2d_pageable_gb_per_s,
        }


def measure_limits(
    device: torch.device,
    files: list[Path],
    copy_bytes: int = COPY_BYTES,
    read_bytes: int = READ_BYTES,
) -> Limits:
    limits = Limits(
        memcpy_gb_per_s=copy_gb_per_s(torch.device("cpu"), torch.device("cpu"), copy_bytes),
        host_memory_bytes=meminfo_bytes("MemTotal"),
        host_available_bytes=meminfo_bytes("MemAvailable"),
    )
    if files:
        measure_disk(limits, files, read_bytes)
        limits.page_cache_read_gb_per_s = cached_read_gb_per_s(first_files(files, read_bytes))
    else:
        limits.notes["disk"] = "no checkpoint files to read"
    if device.type == "cuda":
        limits.h2d_pinned_gb_per_s = copy_gb_per_s(device, torch.device("cpu"), copy_bytes, True)
        limits.h2d_pageable_gb_per_s = copy_gb_per_s(device, torch.device("cpu"), copy_bytes)
        limits.device_free_bytes, limits.device_memory_bytes = torch.cuda.mem_get_info(device)
    return limits


def copy_gb_per_s(
    destination: torch.device, source: torch.device, num_bytes: int, pinned: bool = False
) -> float:
    """GB/s of one large copy from `source` to `destination` memory (bytes copied per
    second: each byte counts once, not for its read and its write)."""
    src = torch.ones(num_bytes, dtype=torch.uint8, device=source, pin_memory=pinned)
    dst = torch.empty(num_bytes, dtype=torch.uint8, device=destination)
    timed = destination if destination.type == "cuda" else source
    seconds = median_seconds(lambda: dst.copy_(src, non_blocking=pinned), timed, 1, 5)
    return num_bytes / seconds / 1e9


def first_files(files: list[Path], max_bytes: int) -> list[Path]:
    """The first of `files` whose sizes add up to `max_bytes` (at least one file)."""
    chosen, total = [], 0
    for path in files:
        if chosen and total >= max_bytes:
            break
        chosen.append(path)
        total += path.stat().st_size
    return chosen


def measure_disk(limits: Limits, files: list[Path], read_bytes: int = READ_BYTES) -> None:
    """Measure the disk's O_DIRECT bandwidth over the first `read_bytes` of `files` two
    ways (one thread of 16 MiB reads; the disk tier's threads and read size), add it to
    `limits` and take the faster way's median as the disk's bandwidth."""
    if not files or "disk" in limits.notes:  # nothing to read, or O_DIRECT refused
        return
    threads = OffloadConfig().disk.io_threads
    chosen = first_files(files, read_bytes)
    # O_DIRECT reads drop the files' cached pages: those cached before are read back in
    # after, so that a method reading through the page cache finds it as it was.
    cached = [path for path in chosen if cached_file_bytes([path]) >= path.stat().st_size]
    try:
        ways = {
            "1 thread, 16 MiB reads": direct_read_gb_per_s(chosen, 16 * 2**20, 1),
            f"{threads} threads, 4 MiB reads": direct_read_gb_per_s(
                chosen, _DISK_READ_BYTES, threads
            ),
        }
    except OSError as error:  # a file system without O_DIRECT (tmpfs) refuses the open
        limits.notes["disk"] = f"O_DIRECT reads failed: {error.strerror or error}"
        return
    finally:
        warm_file_cache(cached)
    for way, gb_per_s in ways.items():
        limits.disk_read_ways_gb_per_s.setdefault(way, []).append(gb_per_s)
    measured = limits.disk_read_ways_gb_per_s.values()
    limits.disk_read_gb_per_s = max(statistics.median(values) for values in measured)
