"""Module prefetch units (`prefetch_unit="module"`, CPU only): each offloaded layer split
into the weight modules that hold its parameters, the read checks those units need (see
`unit_check.py`), and which units are running.

`PrefetchOffloader` composes one `ModuleUnits` when the resolved unit is "module"; with
layer units it composes a `LayerUnits`, which does nothing.
"""

from __future__ import annotations

from typing import Protocol

from offload.errors import ModelError
from offload.memory.slots import slot_of
from offload.offloader.unit_check import UnitReadCheck
from offload.offloader.units import Unit

# A module whose weights are less than this share of its layer's stays resident: a
# norm's few KiB are not worth a copy and a wait.
_SMALL_UNIT_SHARE = 1 / 64


class _Slots(Protocol):
    def ensure_loaded(self, position: int) -> None: ...

    def holds(self, position: int) -> bool: ...


class ModuleUnits:
    """The module units of a prefetch offloader, by position, and what they need beyond
    layer units: the layer each belongs to, the read checks, the running set."""

    def __init__(self, slots: _Slots):
        self._slots = slots
        self._owners: list[Unit] = []  # position -> the offloaded layer it is part of
        self._names: list[str] = []  # position -> the unit's name
        self._running: set[int] = set()  # positions between their wait and their release
        self._checks: dict[int, UnitReadCheck] = {}  # position -> its layer's check

    def split(self, layers: list[Unit]) -> list[Unit]:
        """`layers` as module units, in order (see `split_into_modules`)."""
        units = []
        for layer in layers:
            parts = split_into_modules(layer)
            units += parts
            self._owners += [layer] * len(parts)
        self._names = [unit.name for unit in units]
        return units

    @property
    def num_layers(self) -> int:
        """The offloaded layers the units come from."""
        return len({id(owner) for owner in self._owners})

    def attach_read_checks(self, units: list[Unit]) -> list[UnitReadCheck]:
        """One check per offloaded layer over its module units (see `unit_check.py`)."""
        positions_of: dict[int, list[int]] = {}
        for position, owner in enumerate(self._owners):
            positions_of.setdefault(id(owner), []).append(position)
        checks = []
        for positions in positions_of.values():
            owner = self._owners[positions[0]]
            members = [(p, [param for _, param in units[p].params]) for p in positions]
            checks.append(UnitReadCheck(self, owner.module, owner.name, members))
            self._checks.update(dict.fromkeys(positions, checks[-1]))
        return checks

    def ensure_loaded(self, position: int) -> None:
        """A read of unit `position`'s weights outside its forward: load it if its slot
        holds another, and wait for it."""
        self._slots.ensure_loaded(position)

    def unit_name(self, position: int) -> str:
        return self._names[position]

    def check_compiled(self, position: int) -> None:
        """A compiled graph cannot run the read check: only a layer that passed it runs."""
        check = self._checks.get(position)
        if check is not None and not check.is_verified:
            raise ModelError(check.compile_error())

    def started(self, position: int) -> None:
        """Unit `position` runs now, its bytes in its slot (see `is_running`)."""
        self._running.add(position)

    def released(self, position: int) -> None:
        self._running.discard(position)

    def slot_refilled(self, position: int, num_slots: int) -> None:
        """A load of `position` begins: whoever ran in its slot no longer has its weights
        there."""
        slot = slot_of(position, num_slots)
        self._running.difference_update([p for p in self._running if slot_of(p, num_slots) == slot])

    def is_running(self, position: int) -> bool:
        """True from the end of `position`'s wait to its release, while its slot holds it
        (a load into the slot takes it out of the running set)."""
        return position in self._running and self._slots.holds(position)

    def forget_running(self) -> None:
        """The slots were emptied: no unit has its weights in place."""
        self._running.clear()

    def recover(self) -> None:
        """After an abandoned forward: nothing is running, no read check is active."""
        self._running.clear()
        for check in {id(c): c for c in self._checks.values()}.values():
            check.recover()


def split_into_modules(layer: Unit) -> list[Unit]:
    """`layer` as one unit per module that holds its offloaded weights directly (its
    linear layers, in registration order, which is the order Hugging Face layers call
    them in; a module that runs out of that order is still correct, loaded on demand).
    Each unit is copied, waited for and released on its own, so a copy lands just before
    its module runs: on a CPU the bytes are still in cache when they are read. Neighbours
    are not grouped into bigger units: that puts more bytes in flight (see
    docs/benchmarks.md)."""
    chosen = {id(p) for _, p in layer.params}
    units = []
    for sub_name, sub in layer.module.named_modules():
        params = [(n, p) for n, p in sub.named_parameters(recurse=False) if id(p) in chosen]
        chosen -= {id(p) for _, p in params}  # a parameter shared by two modules: once
        if params:
            name = f"{layer.name}.{sub_name}" if sub_name else layer.name
            units.append(Unit.of(sub, name, params, layer.layer_index))
    total = sum(spec.num_bytes for unit in units for spec in unit.specs)
    return [u for u in units if sum(s.num_bytes for s in u.specs) >= total * _SMALL_UNIT_SHARE]


class LayerUnits:
    """Layer units (`prefetch_unit="layer"`): each unit is its layer, which needs no read
    check and no running set; what `ModuleUnits` does for module units is nothing here."""

    def __init__(self) -> None:
        self.num_layers = 0

    def split(self, layers: list[Unit]) -> list[Unit]:
        self.num_layers = len(layers)
        return layers

    def attach_read_checks(self, units: list[Unit]) -> list[UnitReadCheck]:
        return []

    def check_compiled(self, position: int) -> None:
        pass

    def started(self, position: int) -> None:
        pass

    def released(self, position: int) -> None:
        pass

    def slot_refilled(self, position: int, num_slots: int) -> None:
        pass

    def forget_running(self) -> None:
        pass

    def recover(self) -> None:
        pass
