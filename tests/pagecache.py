"""How much of a file the page cache holds (for tests that reads leave it alone)."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path


def cached_bytes(path: Path) -> int:
    """Bytes of `path` in the page cache (mincore over a private mapping of the file)."""
    size = path.stat().st_size
    with path.open("rb") as file, mmap.mmap(file.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        libc = ctypes.CDLL(None, use_errno=True)
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        buf = (ctypes.c_char * size).from_buffer(mapped)
        result = libc.mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec)
        del buf
        assert result == 0, ctypes.get_errno()
        return sum(v & 1 for v in vec) * mmap.PAGESIZE
