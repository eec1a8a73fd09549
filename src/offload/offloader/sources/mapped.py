"""Units on disk computed on in place (CPU only): each streamed parameter is a view of a
guarded mapping of its file (`memory/mapped_files.py`) and compute reads the page cache,
with no copy and no slot; the kernel is asked to read a unit ahead where its pages are
missing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from offload.memory.disk_layout import TensorRange
from offload.memory.mapped_files import MappedFiles
from offload.offloader.sources.base import DiskSource
from offload.offloader.stats import DiskStats
from offload.offloader.units import Unit


class MappedRead(DiskSource):
    """Hints a unit's pages in on `load`; holds the mappings (their leases) from a
    forward's first `wait` to its `leave`."""

    def __init__(self, mapped: MappedFiles, stored_of: Callable[[torch.Tensor], TensorRange]):
        self._mapped = mapped
        self._stored_of = stored_of  # a streamed parameter -> its bytes in the checkpoint
        self._bytes_mapped = 0  # bytes of mapped units brought to compute so far

    def load(self, unit: Unit, slot_index: int, slot: torch.Tensor) -> None:
        self._mapped.hint(unit.disk.extents)  # only ask the kernel for missing pages
        self._bytes_mapped += unit.disk.read_bytes

    def wait(self, ticket: None) -> None:
        self._mapped.enter()  # a changed file is raised here; else the mapping stays

    def views(self, unit: Unit, slot: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's bytes: a uint8 view of its file's mapping."""
        views = []
        for _, param in unit.params:
            stored = self._stored_of(param)
            views.append(self._mapped.view(Path(stored.path), stored.offset, stored.num_bytes))
        return views

    def release(self, unit: Unit) -> None:
        """A streamed unit's pages leave the process once it has run (they stay in the
        page cache): mapped reads then take one unit's pages of RSS at a time, not the
        whole file's. A later read of them faults them in again, from the same file."""
        if not unit.pages_held:
            self._mapped.drop(unit.disk.extents)

    def leave(self) -> None:
        self._mapped.leave()  # a mapping of a changed file may go now

    def close(self) -> None:
        self._mapped.close()

    def stats(self) -> DiskStats:
        return DiskStats(bytes_mapped=self._bytes_mapped)

    def value_of(
        self, like: torch.Tensor, read: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        self._mapped.enter()  # the mapping stays while it is copied
        try:
            return like.detach().clone()
        finally:
            self._mapped.leave()
