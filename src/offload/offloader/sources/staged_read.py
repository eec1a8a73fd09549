"""Units on disk read into a pinned host staging buffer of their slot, then copied into
the slot on the copy stream: the GPU's path (the CPU takes it too when a test forces it).

A staging thread queues each unit's copy once its read is done, in the order units are
loaded; compute waits for the read on the host and for the copy on the stream. A staging
buffer is read into again only once the copy out of it is done.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from offload.memory.copy_engine import CopyEngine
from offload.memory.disk_reader import DiskReader, ReadTicket
from offload.offloader.sources.base import DiskSource
from offload.offloader.stats import DiskStats
from offload.offloader.units import Unit


class StagedRead(DiskSource):
    """Reads each unit into its slot's staging buffer, then copies it into the slot."""

    def __init__(self, reader: DiskReader, engine: CopyEngine, staging: list[torch.Tensor]):
        self._reader = reader
        self._engine = engine
        self._staging = staging  # per slot, exact-size and page-aligned (O_DIRECT reads)
        self._staged: list[Future | None] = [None] * len(staging)  # per slot: its last load
        self._issuer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-stage")

    def load(self, unit: Unit, slot_index: int, slot: torch.Tensor) -> Future:
        layout = unit.disk
        staging = self._staging[slot_index][: layout.num_bytes]
        previous = self._staged[slot_index]
        released = self._engine.mark_released()  # the slot's last reader, on the compute side
        after = _after_copy_out(self._engine, previous)
        read = self._reader.read(staging, layout.extents, after=after, moves=layout.moves)
        copy = self._issuer.submit(self._copy_in, read, slot[: layout.num_bytes], staging, released)
        self._staged[slot_index] = copy
        return copy

    def _copy_in(self, read: ReadTicket, slot, staging, released) -> Any:
        self._reader.wait(read, count_stall=False)
        return self._engine.copy(slot, staging, after=released)

    def wait(self, ticket: Future) -> None:
        if not ticket.done():
            started = time.perf_counter()
            ticket.exception()
            self._reader.stats.stall_s += time.perf_counter() - started
            self._reader.stats.num_stalls += 1
        self._engine.wait(ticket.result())

    def failed_transiently(self) -> bool:
        return self._reader.failed_transiently

    def invalidate(self) -> None:
        self._reader.invalidate()
        self._issuer.submit(_nothing).result()  # stale copies are queued before it
        self._staged = [None] * len(self._staged)

    def close(self) -> None:
        self._issuer.shutdown(wait=True)
        self._reader.close()

    def stats(self) -> DiskStats:
        staging_bytes = sum(buffer.numel() for buffer in self._staging)
        return DiskStats.of_reads(self._reader.stats, staging_bytes)


def _after_copy_out(engine: CopyEngine, previous: Future | None) -> Callable[[], None]:
    """Runs on an I/O thread before a read into a staging buffer: the copy out of the
    buffer's last unit has finished (so the read does not overwrite bytes in flight)."""

    def wait_for_copy_out() -> None:
        if previous is not None:
            engine.host_wait(previous.result())

    return wait_for_copy_out


def _nothing() -> None:
    return None
