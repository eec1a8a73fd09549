"""Units on disk read straight into their slot (the CPU computes on the slot): the slot
ring is the staging ring."""

from __future__ import annotations

import torch

from offload.memory.disk_reader import DiskReader, ReadTicket
from offload.offloader.sources.base import DiskSource
from offload.offloader.stats import DiskStats
from offload.offloader.units import Unit


class DirectRead(DiskSource):
    """Reads each unit's runs into its slot on the reader's I/O threads."""

    def __init__(self, reader: DiskReader):
        self._reader = reader

    def load(self, unit: Unit, slot_index: int, slot: torch.Tensor) -> ReadTicket:
        layout = unit.disk
        return self._reader.read(slot[: layout.num_bytes], layout.extents, moves=layout.moves)

    def wait(self, ticket: ReadTicket) -> None:
        self._reader.wait(ticket)

    def failed_transiently(self) -> bool:
        return self._reader.failed_transiently

    def invalidate(self) -> None:
        self._reader.invalidate()

    def close(self) -> None:
        self._reader.close()

    def stats(self) -> DiskStats:
        return DiskStats.of_reads(self._reader.stats)
