"""Units in host memory: each is one exact-size host slab, copied into its slot."""

from __future__ import annotations

from typing import Any

import torch

from offload.memory.copy_engine import CopyEngine
from offload.offloader.sources.base import UnitSource
from offload.offloader.units import Unit


class SlabSource(UnitSource):
    """One copy per unit, from its slab, by the copy engine."""

    def __init__(self, engine: CopyEngine):
        self._engine = engine

    def load(self, unit: Unit, slot_index: int, slot: torch.Tensor) -> Any:
        num_bytes = unit.slot_bytes
        # The copy waits until every read issued so far (the slot's last user) is done.
        return self._engine.copy(
            slot[:num_bytes], unit.slab.buffer[:num_bytes], after=self._engine.mark_released()
        )

    def wait(self, ticket: Any) -> None:
        self._engine.wait(ticket)
