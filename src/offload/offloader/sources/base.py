"""The contract of a unit source, and of the disk tier's sources beyond it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from offload.offloader.stats import DiskStats
from offload.offloader.units import Unit


class UnitSource(ABC):
    """Brings units into their device slots: `load` starts it and hands back a ticket,
    `wait` makes compute wait for the ticket's unit to be in its slot."""

    @abstractmethod
    def load(self, unit: Unit, slot_index: int, slot: torch.Tensor) -> Any:
        """Start bringing `unit` into `slot` (its bytes from the slot's first); return a
        ticket for `wait`."""

    @abstractmethod
    def wait(self, ticket: Any) -> None:
        """Make compute wait until the unit of `ticket` is in its slot (a fault of the
        load is raised here, in the thread that runs the model)."""

    def views(self, unit: Unit, slot: torch.Tensor) -> list[torch.Tensor]:
        """Each of `unit`'s parameters where compute reads it (uint8): in its slot."""
        return unit.slot_views(slot)

    def release(self, unit: Unit) -> None:
        """`unit` has run (its slot is about to be refilled): what it held may go."""
        return None  # (a slot or a slab stays: nothing to let go of)


class DiskSource(UnitSource):
    """A source of the units on disk, which also does for all of them what the disk tier
    is asked: forget loads in flight, let go of the files between forwards, close, count."""

    def invalidate(self) -> None:
        """Forget every load in flight (after an abandoned forward): none lands after this
        returns, so the slots must all be loaded again."""

    def leave(self) -> None:
        """No forward runs now (it ended or was abandoned)."""

    def failed_transiently(self) -> bool:
        """Whether a read failed on an unchanged file (an I/O error): `invalidate` then
        lets reads start again."""
        return False

    def close(self) -> None:
        """End the source's threads and let go of its files."""

    def stats(self) -> DiskStats:
        return DiskStats()

    def value_of(
        self, like: torch.Tensor, read: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """A streamed parameter's value (for `state_dict()`): by default `read(like)`
        reads it from the checkpoint."""
        return read(like)


class Unopened(DiskSource):
    """The disk tier before its files are opened (or with no unit streaming): nothing
    loads, and a value is read from the checkpoint."""

    def load(self, unit: Unit, slot_index: int, slot: torch.Tensor) -> Any:
        raise AssertionError(f"{unit.name} loaded from disk before the files were opened")

    def wait(self, ticket: Any) -> None:
        raise AssertionError("a wait for a unit on disk before the files were opened")
