"""Shared helpers for the benchmarks: timing with warm-up and medians, machine info, results.

They live in the package (`offload.bench`, which `offload bench` runs) and are named here
for the scripts."""

from __future__ import annotations

from pathlib import Path

import torch

from offload.bench.checkpoint import write_random_checkpoint
from offload.bench.host_io import (
    cached_file_bytes,
    cached_read_gb_per_s,
    direct_read_gb_per_s,
    meminfo_bytes,
    process_memory_bytes,
    reset_peak_rss,
)
from offload.bench.machine import machine, median_seconds, save_json, synchronize
from offload.memory.page_cache import drop_cached as drop_file_cache
from offload.memory.page_cache import read_cached as warm_file_cache

__all__ = [
    "RESULTS",
    "cached_file_bytes",
    "cached_read_gb_per_s",
    "direct_read_gb_per_s",
    "drop_file_cache",
    "machine",
    "median_seconds",
    "meminfo_cached_bytes",
    "process_memory_bytes",
    "reset_peak_rss",
    "save",
    "synchronize",
    "warm_file_cache",
    "write_random_checkpoint",
]

RESULTS = Path(__file__).parent / "results"


def save(name: str, device: torch.device, payload: dict[str, object]) -> Path:
    return save_json(RESULTS, name, device, payload)


def meminfo_cached_bytes() -> int:
    """The machine's page cache (`Cached` in /proc/meminfo), in bytes."""
    return meminfo_bytes("Cached")
