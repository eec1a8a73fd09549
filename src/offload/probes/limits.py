"""The machine's limits, measured again and again in the same run as `offload bench`'s
methods (a virtual machine's rates drift within minutes): host memory copy, the disk's
sequential `O_DIRECT` read and reads from the page cache over the checkpoint's own files,
and on a GPU host-to-device copies from pinned and from pageable memory."""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from offload.config import OffloadConfig
from offload.errors import ModelError
from offload.memory.disk_layout import Extent
from offload.memory.host import meminfo_bytes
from offload.memory.placement import Link
from offload.probes import disk, link
from offload.probes.disk import cached_read_gb_per_s, first_files
from offload.probes.settings import DEFAULT_SETTINGS, MeasureSettings
from offload.sizes import MIB

TIER_WAY = f"{OffloadConfig().disk.io_threads} threads, a layer split over them"
SEQUENTIAL_WAY = "1 thread, 64 MiB reads"


@dataclass
class Limits:
    """Bandwidths in GB/s (1e9 bytes; None: not measured here, see `disk_note`) and the
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
    # The tier's way with the CPU computing meanwhile (a CPU device only), each time.
    disk_busy_read_gb_per_s: list[float] = field(default_factory=list)
    # The memory copy, each time it was measured (`memcpy_gb_per_s`: their median).
    memcpy_samples_gb_per_s: list[float] = field(default_factory=list)
    # On a CPU, the prefetch backend's copies as they run between a forward's layers (a
    # cut model, every layer streamed), each time: they drift apart from a plain memory
    # copy (`planner.compute.ForwardCopies`).
    forward_copy_samples_gb_per_s: list[float] = field(default_factory=list)
    # On a CPU, reading memory with torch's threads (a sum over more than the caches hold),
    # before each run: a CPU decode step reads every weight once, so weights' bytes over it
    # is the step's floor (`memory_read_gb_per_s`: the median).
    memory_read_gb_per_s: float | None = None
    memory_read_samples_gb_per_s: list[float] = field(default_factory=list)
    disk_note: str | None = None  # why the disk was not measured (None: it was, or no tier)
    planner_note: str | None = None  # why the planner made no prediction

    @classmethod
    def from_dict(cls, data: dict) -> Limits:
        """Limits read back from their JSON; a result written before the notes were fields
        (a "notes" dict keyed "disk" and "planner") too."""
        data = dict(data)
        notes = data.pop("notes", None) or {}
        data.setdefault("disk_note", notes.get("disk"))
        data.setdefault("planner_note", notes.get("planner"))
        return cls(**data)

    def tier_disk_gb_per_s(self) -> float | None:
        """The median of the disk's reads made the way the disk tier reads (its threads
        and read size): the rate its reads get, where `disk_read_gb_per_s` is the
        faster way's (the bound)."""
        samples = self.disk_read_ways_gb_per_s.get(TIER_WAY)
        return statistics.median(samples) if samples else None

    def tier_disk_busy_gb_per_s(self) -> float | None:
        """The median of the tier's reads beside compute (None: not measured)."""
        samples = self.disk_busy_read_gb_per_s
        return statistics.median(samples) if samples else None

    def link_gb_per_s(self) -> dict[str, float | None]:
        """The bandwidth of each link in `bound.LINKS`."""
        return {
            Link.MEMCPY: self.memcpy_gb_per_s,
            Link.DISK: self.disk_read_gb_per_s,
            Link.PAGE_CACHE: self.page_cache_read_gb_per_s,
            Link.H2D_PINNED: self.h2d_pinned_gb_per_s,
            Link.H2D_PAGEABLE: self.h2d_pageable_gb_per_s,
        }


def measure_limits(
    device: torch.device,
    files: list[Path],
    settings: MeasureSettings = DEFAULT_SETTINGS,
    layer_reads: list[tuple[Extent, ...]] | None = None,
) -> Limits:
    """The limits, each measured once (`settings`: how much each probe moves; at most
    `disk_bytes` of the checkpoint is read per way of reading)."""
    limits = Limits(
        memcpy_gb_per_s=0.0,
        host_memory_bytes=meminfo_bytes("MemTotal") or 0,
        host_available_bytes=meminfo_bytes("MemAvailable") or 0,
    )
    copy_bytes = settings.copy_bytes
    measure_memcpy(limits, settings)
    if device.type == "cpu":
        measure_memory_read(limits, settings)
    if files:
        measure_disk(limits, files, device, settings, layer_reads)
        chosen = first_files(files, settings.disk_bytes)
        limits.page_cache_read_gb_per_s = cached_read_gb_per_s(chosen)
    else:
        limits.disk_note = "no checkpoint files to read"
    if device.type == "cuda":
        limits.h2d_pinned_gb_per_s = _copy_gb_per_s(device, copy_bytes, pinned=True)
        limits.h2d_pageable_gb_per_s = _copy_gb_per_s(device, copy_bytes, pinned=False)
        limits.device_free_bytes, limits.device_memory_bytes = torch.cuda.mem_get_info(device)
    return limits


def measure_memcpy(limits: Limits, settings: MeasureSettings) -> None:
    """One more measurement of the memory copy (it drifts as the disk does)."""
    cpu = torch.device("cpu")
    limits.memcpy_samples_gb_per_s.append(_copy_gb_per_s(cpu, settings.copy_bytes))
    limits.memcpy_gb_per_s = statistics.median(limits.memcpy_samples_gb_per_s)


def measure_memory_read(limits: Limits, settings: MeasureSettings) -> None:
    """One more measurement of reading host memory with torch's threads: a sum over
    `settings.copy_bytes` of float32 (more than the caches hold, as the copy)."""
    values = torch.ones(settings.copy_bytes // 4)
    values.sum()  # (its pages touched, its threads started)
    times = []
    for _ in range(5):
        started = time.perf_counter()
        values.sum()
        times.append(time.perf_counter() - started)
    limits.memory_read_samples_gb_per_s.append(values.nbytes / statistics.median(times) / 1e9)
    limits.memory_read_gb_per_s = statistics.median(limits.memory_read_samples_gb_per_s)


def _copy_gb_per_s(device: torch.device, num_bytes: int, *, pinned: bool | None = None) -> float:
    """GB/s of one large host -> `device` copy (a memory copy on a CPU), the planner's
    own probe: each byte counts once, not for its read and its write."""
    return link.link_gb_per_s(device, num_bytes, 1, 5, pinned=pinned)


def measure_disk(
    limits: Limits,
    files: list[Path],
    device: torch.device,
    settings: MeasureSettings,
    layer_reads: list[tuple[Extent, ...]] | None = None,
) -> None:
    """Measure the disk's O_DIRECT bandwidth over the first `disk_bytes` of `files` two
    ways: one thread of 64 MiB reads in file order, and the disk tier's way (its reader,
    threads and read size, the layers in the order they run: `layer_reads`, see
    `probes.layer_reads`); and the tier's way again with the CPU computing beside (where
    the device is the CPU, its cores are the reads' too). Add them to `limits` and take
    the faster way's median as the disk's bandwidth."""
    if not files or limits.disk_note is not None:  # nothing to read, or O_DIRECT refused
        return
    threads = OffloadConfig().disk.io_threads
    read_bytes = settings.disk_bytes
    chosen = first_files(files, read_bytes)
    try:
        # O_DIRECT reads drop the files' cached pages: those cached before are read back
        # in after, so that a method reading through the page cache finds it as it was.
        with disk.kept_warm(files):
            ways = {
                SEQUENTIAL_WAY: disk.disk_gb_per_s(chosen, read_bytes, 1),
                # The planner's probe: the disk tier's own reader, threads and read size.
                TIER_WAY: disk.disk_gb_per_s(files, read_bytes, threads, reads=layer_reads),
            }
            if device.type == "cpu":  # computing on the CPU
                busy = disk.disk_gb_per_s(
                    files, read_bytes, threads, computing=True, reads=layer_reads
                )
    except (OSError, ModelError) as error:  # no O_DIRECT here (tmpfs refuses the open)
        why = getattr(error, "strerror", None) or error
        limits.disk_note = f"O_DIRECT reads failed: {why}"
        return
    for way, gb_per_s in ways.items():
        limits.disk_read_ways_gb_per_s.setdefault(way, []).append(gb_per_s)
    measured = limits.disk_read_ways_gb_per_s.values()
    limits.disk_read_gb_per_s = max(statistics.median(values) for values in measured)
    if device.type == "cpu":
        limits.disk_busy_read_gb_per_s.append(busy)


def rank_rates(path: Path, budget_bytes: int | None) -> tuple[float, float | None]:
    """A pipeline rank's rates for the split, GB/s, in a fraction of a second: reading RAM
    with torch's threads, and, where a budget may leave weights to stream, the disk tier's
    O_DIRECT reads of the checkpoint at `path` (its pages cached before stay cached; None
    without a budget, a checkpoint of files or O_DIRECT). The probe's buffers stay within
    an eighth of the budget."""
    share = 256 * MIB if budget_bytes is None else max(16 * MIB, min(256 * MIB, budget_bytes // 8))
    settings = dataclasses.replace(DEFAULT_SETTINGS, copy_bytes=share, repeats=3)
    limits = Limits(memcpy_gb_per_s=0.0)
    measure_memory_read(limits, settings)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if budget_bytes is None or not files:
        return limits.memory_read_gb_per_s or 0.0, None
    threads = OffloadConfig().disk.io_threads
    try:
        with disk.kept_warm(files):
            chosen = first_files(files, share)
            rate = disk.disk_gb_per_s(chosen, share, threads, max_read_bytes=share // 4)
    except (OSError, ModelError):  # (no O_DIRECT here: tmpfs refuses the open)
        rate = None
    return limits.memory_read_gb_per_s or 0.0, rate
