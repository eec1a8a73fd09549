"""Units on disk read straight into their slot (the CPU computes on the slot): the slot
ring is the staging ring."""

from __future__ import annotations

import torch

from offload.memory.disk_reader import DiskReader, ReadTicket
from offload.offloader.sources.base import DiskSource
from offload.offloader.units import Unit


class DirectRead(DiskSource):
    """Reads each unit's runs into its slot on the reader's I/O threads."""

    def __init__(self, reader: DiskReader):
        self._reader = reader

    def load(self, unit: Unit, slot_index: int, slot: torch.Tensor) -> ReadTicket:
        layout = unit.disk
        return self._reader.read(slot[: layout.num_bytes], layout.extents)

    def wait(self, ticket: ReadTicket) -> None:
        self._reader.wait(ticket)

    def invalidate(self) -> None:
        self._reader.invalidate()

    def close(self) -> None:
        self._reader.close()

    def stats(self) -> dict[str, float | int]:
        return {**read_stats(self._reader), "staging_bytes": 0}


def read_stats(reader: DiskReader) -> dict[str, float | int]:
    read = reader.stats
    return {
        "disk_bytes_mapped": 0,
        "disk_bytes_read": read.bytes_read,
        "disk_read_s": read.busy_s,
        "disk_read_gb_per_s": read.read_gb_per_s,
        "disk_stall_s": read.stall_s,
        "disk_num_stalls": read.num_stalls,
    }
