"""Where a layer's tensors land in a host buffer when read from their files, and the
aligned reads that put them there.

`plan_layout` places the runs of bytes so that every read can bypass the page cache
(`O_DIRECT` needs the buffer address, the file offset and the length aligned to the
block size): a tensor lands in the buffer at the same offset modulo `ALIGN` as in its
file. Files written by the safetensors library put tensors 8 bytes apart at best, and a
matrix product's sums depend on where its weight starts (MKL's on the CPU, cuBLAS's
choice of kernel on a GPU), so the layout also gives each tensor a home at a multiple of
`HOME_ALIGN`, as a slab in host memory does, and the moves that bring it there once its
bytes have landed: the same bits as the model computed without offloading.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

ALIGN = 4096  # O_DIRECT alignment that every Linux block device accepts
HOME_ALIGN = 256  # a tensor's first byte in its buffer (a host slab's: ALIGN_BYTES)
# Where a weight computed on in place (a mapping) must start for the CPU's products to
# sum as on the model's own tensors: the CPU allocator's alignment.
MAP_ALIGN = 64


def maps_exactly(offset: int, ndim: int) -> bool:
    """Whether a tensor of `ndim` dimensions at byte `offset` of its file can be computed
    on in place: a product sums over a matrix, so a matrix must start at a multiple of
    `MAP_ALIGN`; a 1-D weight is read element by element, exact anywhere."""
    return ndim < 2 or offset % MAP_ALIGN == 0


@dataclass(frozen=True)
class TensorRange:
    """One tensor's bytes in a file (and its dtype, where known)."""

    path: Path
    offset: int
    num_bytes: int
    dtype: torch.dtype | None = None


@dataclass(frozen=True)
class Extent:
    """One aligned read: `num_bytes` of `path` from `file_offset` into the buffer at
    `buffer_offset` (the last block may run past the end of the file: the read is short)."""

    path: Path
    file_offset: int
    num_bytes: int
    buffer_offset: int


@dataclass(frozen=True)
class Move:
    """`num_bytes` in a buffer from `source` to `target` (the ranges may overlap)."""

    source: int
    target: int
    num_bytes: int


@dataclass(frozen=True)
class DiskLayout:
    """Where a layer's tensors land in its buffer, the reads that put them there, and the
    moves, in order, that bring each tensor to its aligned home after the reads."""

    extents: tuple[Extent, ...]
    tensor_offsets: tuple[int, ...]  # per input range, its home in the buffer
    num_bytes: int  # the buffer size the layout needs
    moves: tuple[Move, ...] = ()

    @property
    def read_bytes(self) -> int:
        return sum(extent.num_bytes for extent in self.extents)


def plan_layout(
    ranges: Sequence[TensorRange], align: int = ALIGN, home_align: int = HOME_ALIGN
) -> DiskLayout:
    """Aligned reads covering `ranges`: ranges of one file whose aligned covers touch are
    read as one run; runs follow each other in the buffer, each at an aligned offset.
    Each range then has a home at a multiple of `home_align` (`_homes`)."""
    order = sorted(range(len(ranges)), key=lambda i: (str(ranges[i].path), ranges[i].offset))
    runs: list[list[int]] = []  # [first aligned byte, end aligned byte] per run
    run_paths: list[Path] = []
    run_of = [0] * len(ranges)
    for i in order:
        piece = ranges[i]
        start = piece.offset // align * align
        end = -(-(piece.offset + piece.num_bytes) // align) * align
        if runs and run_paths[-1] == piece.path and start <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], end)
        else:
            runs.append([start, end])
            run_paths.append(piece.path)
        run_of[i] = len(runs) - 1
    extents, placed = [], 0
    for (start, end), path in zip(runs, run_paths, strict=True):
        extents.append(Extent(path, start, end - start, placed))
        placed += end - start
    landed = [
        extents[run_of[i]].buffer_offset + ranges[i].offset - extents[run_of[i]].file_offset
        for i in range(len(ranges))
    ]
    homes, moves, num_bytes = _homes(landed, [r.num_bytes for r in ranges], placed, home_align)
    return DiskLayout(tuple(extents), homes, num_bytes, moves)


def _homes(
    landed: Sequence[int], sizes: Sequence[int], end: int, home_align: int
) -> tuple[tuple[int, ...], tuple[Move, ...], int]:
    """Per tensor (its bytes landed at `landed`, of `sizes`, in a buffer read up to
    `end`), a home at a multiple of `home_align`, the moves that take it there, and the
    buffer size. In buffer order, a tensor goes back to its landing offset rounded down
    where that is clear of the homes before it, else to a home past `end`. The moves past
    `end` run first; then a sweep of moves to lower offsets, in buffer order, never writes
    over bytes still to move (a range overlapping the one before it went past `end`).
    Files whose tensors' sizes are multiples of `home_align` (nearly every weight's) need
    no home past `end`."""
    homes = list(landed)
    tail, early, late = -(-end // home_align) * home_align, [], []
    clear_from = 0  # the end of the homes placed so far below `end`
    for i in sorted(range(len(landed)), key=lambda i: (landed[i], sizes[i])):
        start, size = landed[i], sizes[i]
        down = start // home_align * home_align
        if down >= clear_from:
            homes[i], clear_from = down, down + size
            if down != start:
                late.append(Move(start, down, size))
        else:
            homes[i] = tail
            early.append(Move(start, tail, size))
            tail = -(-(tail + size) // home_align) * home_align
    num_bytes = max(end, max((m.target + m.num_bytes for m in early), default=0))
    return tuple(homes), tuple(early + late), num_bytes


class PendingMoves:
    """A read's moves, run by the thread whose part of the read lands last (a part skipped
    or failed never counts down: the buffer is another read's, or the read raises)."""

    def __init__(self, base: int, moves: tuple[Move, ...], num_parts: int):
        self._base = base  # the buffer's address
        self._moves = moves
        self._left = num_parts
        self._lock = threading.Lock()

    def landed(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left:
                return
        for move in self._moves:  # memmove: the ranges overlap; ctypes lets the GIL go
            ctypes.memmove(self._base + move.target, self._base + move.source, move.num_bytes)


def aligned_empty(num_bytes: int, align: int = ALIGN) -> torch.Tensor:
    """A uint8 host buffer of `num_bytes` whose first byte is `align`-aligned; one of a
    huge page or more is a fresh mapping of its own that starts on a huge page boundary
    and asks for huge pages (see `_huge_page_buffer`)."""
    if num_bytes >= HUGE_PAGE and sys.platform.startswith("linux"):
        return _huge_page_buffer(num_bytes)
    raw = torch.empty(num_bytes + align, dtype=torch.uint8)
    skip = -raw.data_ptr() % align
    return raw[skip : skip + num_bytes]


HUGE_PAGE = 2 * 2**20  # x86-64's transparent huge page


def _huge_page_buffer(num_bytes: int) -> torch.Tensor:
    """`num_bytes` of a fresh anonymous mapping (never touched: memory the allocator hands
    back again would keep its small pages), aligned to a huge page and advised to use
    them. O_DIRECT reads pin every page of their buffer, page by page, so reads into huge
    pages go faster than into small ones (docs/benchmarks.md). Where the
    kernel has them off, the advice is refused and the pages stay small. The mapping
    lives as long as the tensor."""
    # Private: a shared anonymous mapping is shmem, which gets no huge pages by default.
    mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE
    with contextlib.suppress(OSError, AttributeError):  # no THP here: small pages
        mapping.madvise(mmap.MADV_HUGEPAGE, skip, num_bytes // HUGE_PAGE * HUGE_PAGE)
    return raw[skip : skip + num_bytes]


def slot_buffer(num_bytes: int, device: torch.device, read_into: bool) -> torch.Tensor:
    """A device slot of `num_bytes`; on the CPU, aligned where reads land in it directly
    (`read_into`: O_DIRECT needs the alignment)."""
    if device.type == "cpu" and read_into:
        return aligned_empty(num_bytes)
    return torch.empty(num_bytes, dtype=torch.uint8, device=device)
