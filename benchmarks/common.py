"""Shared helpers for the benchmarks: timing with warm-up and medians, machine info, results.

Most live in the package (`offload.bench`, which `offload bench` runs) and are named here
for the scripts; the page-cache residency figures of the disk benchmark stay here."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from offload.bench.checkpoint import write_random_checkpoint
from offload.bench.host_io import (
    cached_read_gb_per_s,
    direct_read_gb_per_s,
    drop_file_cache,
    process_memory_bytes,
    reset_peak_rss,
    warm_file_cache,
)
from offload.bench.machine import machine, median_seconds, save_json, synchronize

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


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def meminfo_cached_bytes() -> int:
    """The machine's page cache (`Cached` in /proc/meminfo), in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Cached:"):
            return int(line.split()[1]) * 1024
    return 0


def cached_file_bytes(paths: list[Path]) -> int:
    """Bytes of the files that are in the page cache now (`mincore` over a mapping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    int_ = ctypes.c_int
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, int_, int_, int_, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    total = 0
    for path in paths:
        size = path.stat().st_size
        if size == 0:
            continue
        descriptor = os.open(path, os.O_RDONLY)
        try:
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, descriptor, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
            try:
                pages = ctypes.create_string_buffer((size + _PAGE_BYTES - 1) // _PAGE_BYTES)
                if libc.mincore(address, size, pages) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
                total += sum(byte & 1 for byte in pages.raw) * _PAGE_BYTES
            finally:
                libc.munmap(address, size)
        finally:
            os.close(descriptor)
    return total
