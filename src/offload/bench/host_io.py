"""Figures of this machine's host side (Linux): the process's resident memory and its
peak, and the sequential read bandwidth of files from the disk (`O_DIRECT`) and from the
page cache."""

from __future__ import annotations

import os
import time
from pathlib import Path

from offload.memory.page_cache import cached_bytes, drop_cached, read_cached

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def process_memory_bytes() -> dict[str, int]:
    """This process's resident set now (`VmRSS`) and its peak (`VmHWM`), in bytes."""
    fields = {"VmRSS": "rss_bytes", "VmHWM": "peak_rss_bytes"}
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in fields:
            found[fields[key]] = int(value.split()[0]) * 1024  # the kernel reports kB
    return found


def reset_peak_rss() -> None:
    """Start `VmHWM` again from the current RSS (Linux's clear_refs value 5), after
    freeing what Python and glibc still hold, so that a peak belongs to what follows."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # returns freed heap pages to the kernel
    Path("/proc/self/clear_refs").write_text("5")


def direct_read_gb_per_s(
    paths: list[Path], chunk_bytes: int = 16 * 2**20, num_threads: int = 1
) -> float:
    """The disk's own sequential read bandwidth: the files read once, in order, with
    `O_DIRECT` (no page cache) in aligned chunks, their cached pages dropped first. With
    several threads each takes the next chunk in that order, so that many reads are in
    flight at once (as in a reader with that many I/O threads). GB/s (1e9 bytes)."""
    drop_cached(paths)
    return _sequential_read_gb_per_s(paths, chunk_bytes, os.O_DIRECT, num_threads)


def cached_read_gb_per_s(paths: list[Path], chunk_bytes: int = 16 * 2**20) -> float:
    """Read bandwidth from the page cache: the files read once to fill it, then read again
    in order, in chunks into one buffer on one thread. GB/s (1e9 bytes)."""
    read_cached(paths)
    return _sequential_read_gb_per_s(paths, chunk_bytes, 0, 1)


def _sequential_read_gb_per_s(
    paths: list[Path], chunk_bytes: int, flags: int, num_threads: int
) -> float:
    import mmap
    import threading
    from concurrent.futures import ThreadPoolExecutor

    chunks = iter(
        [(path, offset) for path in paths for offset in range(0, path.stat().st_size, chunk_bytes)]
    )
    lock = threading.Lock()

    def read_chunks() -> int:
        buffer = mmap.mmap(-1, chunk_bytes)  # an anonymous mapping is page aligned (O_DIRECT)
        descriptors: dict[Path, int] = {}
        num_bytes = 0
        try:
            while True:
                with lock:
                    chunk = next(chunks, None)
                if chunk is None:
                    return num_bytes
                path, offset = chunk
                if path not in descriptors:
                    descriptors[path] = os.open(path, os.O_RDONLY | flags)
                # The last read of a file is short, which O_DIRECT allows.
                num_bytes += os.preadv(descriptors[path], [buffer], offset)
        finally:
            for descriptor in descriptors.values():
                os.close(descriptor)

    started = time.perf_counter()
    with ThreadPoolExecutor(num_threads) as pool:
        futures = [pool.submit(read_chunks) for _ in range(num_threads)]
        num_bytes = sum(future.result() for future in futures)
    return num_bytes / (time.perf_counter() - started) / 1e9


def meminfo_bytes(field: str) -> int:
    """A field of /proc/meminfo (`MemTotal`, `MemAvailable`, ...) in bytes; 0 if absent."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == field:
            return int(value.split()[0]) * 1024  # the kernel reports kB
    return 0


def cached_file_bytes(paths: list[Path]) -> int:
    """Bytes of the files that are in the page cache now (`mincore` over a mapping)."""
    return sum(cached_bytes(path) for path in paths)
