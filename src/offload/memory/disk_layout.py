"""Where a layer's tensors land in a host buffer when read from their files, and the
aligned reads that put them there.

`plan_layout` places the runs of bytes so that every read can bypass the page cache
(`O_DIRECT` needs the buffer address, the file offset and the length aligned to the
block size): a tensor sits in the buffer at the same offset modulo `ALIGN` as in its
file, so a safetensors file whose tensors are aligned to their dtype gives aligned views.
"""

from __future__ import annotations

import contextlib
import mmap
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

ALIGN = 4096  # O_DIRECT alignment that every Linux block device accepts


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
class DiskLayout:
    """Where a layer's tensors land in its buffer, and the reads that put them there."""

    extents: tuple[Extent, ...]
    tensor_offsets: tuple[int, ...]  # per input range, its first byte in the buffer
    num_bytes: int  # the buffer size the layout needs

    @property
    def read_bytes(self) -> int:
        return sum(extent.num_bytes for extent in self.extents)


def plan_layout(ranges: Sequence[TensorRange], align: int = ALIGN) -> DiskLayout:
    """Aligned reads covering `ranges`: ranges of one file whose aligned covers touch are
    read as one run; runs follow each other in the buffer, each at an aligned offset."""
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
    offsets = tuple(
        extents[run_of[i]].buffer_offset + ranges[i].offset - extents[run_of[i]].file_offset
        for i in range(len(ranges))
    )
    return DiskLayout(tuple(extents), offsets, placed)


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
