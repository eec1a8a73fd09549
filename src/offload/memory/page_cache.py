"""How much of a file's byte ranges the page cache holds (`mincore` over a mapping); and
files dropped from it or read into it, for measurements that want it one way or the other."""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

_libc = ctypes.CDLL(None, use_errno=True)


def cached_bytes(path: Path, ranges: Iterable[tuple[int, int]] | None = None) -> int:
    """Bytes of `path` (of its `(offset, num_bytes)` ranges, default the whole file) in
    the page cache, counted by whole pages. 0 where it cannot be told (not Linux)."""
    size = os.stat(path).st_size
    if size == 0 or not hasattr(_libc, "mincore"):
        return 0
    ranges = [(0, size)] if ranges is None else list(ranges)
    with (
        open(path, "rb") as file,
        mmap.mmap(file.fileno(), size, access=mmap.ACCESS_READ) as mapped,
    ):
        address = _address(mapped)
        total = 0
        for offset, num_bytes in ranges:
            end = min(size, offset + num_bytes)
            first = offset // mmap.PAGESIZE * mmap.PAGESIZE
            if end <= first:
                continue
            pages = -(-(end - first) // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(ctypes.c_void_p(address + first), ctypes.c_size_t(end - first), vec):
                return 0
            total += sum(v & 1 for v in vec) * mmap.PAGESIZE
        return total


def cached_fraction(ranges: Sequence[tuple[Path, int, int]]) -> float:
    """The share of `(path, offset, num_bytes)` ranges the page cache holds."""
    by_file: dict[Path, list[tuple[int, int]]] = {}
    for path, offset, num_bytes in ranges:
        by_file.setdefault(Path(path), []).append((offset, num_bytes))
    total = sum(num_bytes for _, _, num_bytes in ranges)
    found = sum(cached_bytes(path, pieces) for path, pieces in by_file.items())
    return found / total if total else 0.0


def drop_cached(paths: Iterable[Path]) -> None:
    """Drop the files' pages from the page cache (written pages are flushed first: the
    kernel drops clean pages only)."""
    for path in paths:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


def read_cached(paths: Iterable[Path], chunk_bytes: int = 64 * 2**20) -> None:
    """Read the files once through the page cache, so later reads find them there."""
    for path in paths:
        with open(path, "rb", buffering=0) as file:
            while file.read(chunk_bytes):
                pass


def _address(mapped: mmap.mmap) -> int:
    """The first byte's address of a read-only mapping (ctypes needs a writable buffer)."""
    return np.frombuffer(mapped, dtype=np.uint8, count=1).ctypes.data
