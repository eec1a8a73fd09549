"""Shared helpers for the benchmarks: timing with warm-up and medians, machine info, results.

They live in the package (`offload.bench`, which `offload bench` runs) and are named here
for the scripts."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

# The scripts time compiled CPU steps in their steady state: a step's first call waits for
# its compile (or load) instead of decoding eagerly beside it (the default, issue 47), and
# a server they start waits for its steps before it listens. `scale.py` measures the default.
os.environ.setdefault("OFFLOAD_CPU_COMPILE", "wait")

import torch

from offload.bench.checkpoint import write_random_checkpoint
from offload.bench.machine import median_seconds, save_json, synchronize
from offload.memory.host import meminfo_bytes
from offload.memory.page_cache import drop_cached as drop_file_cache
from offload.memory.page_cache import read_cached as warm_file_cache
from offload.probes.disk import cached_file_bytes, cached_read_gb_per_s, disk_gb_per_s
from offload.probes.host import (
    machine,
    process_memory_bytes,
    reset_peak_rss,
)

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


def child_row(command: list[str], label: str) -> dict | None:
    """The last JSON line a benchmark's child process printed (one setting in a fresh
    process); None, said with its stderr's tail, where it failed."""
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        print(f"{label}: failed ({done.returncode}): {done.stderr.strip()[-1500:]}")
        return None
    return json.loads(lines[-1])


def meminfo_cached_bytes() -> int:
    """The machine's page cache (`Cached` in /proc/meminfo), in bytes."""
    return meminfo_bytes("Cached") or 0


def direct_read_gb_per_s(files: list[Path], chunk_bytes: int, num_threads: int) -> float:
    """The files read once, in order, around the page cache (`O_DIRECT`) by the disk tier's
    reader on `num_threads` threads in `chunk_bytes` requests; GB/s (1e9 bytes)."""
    total = sum(path.stat().st_size for path in files)
    return disk_gb_per_s(files, total, num_threads, chunk_bytes=chunk_bytes)


def in_threads(function, count: int) -> None:
    """`function(i)` for i in range(count), each in a thread of its own, all at once
    (clients of a serving engine); returns when every one has."""
    threads = [threading.Thread(target=function, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
