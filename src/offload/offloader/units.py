"""What one prefetch copy brings in, and how far ahead: pure functions of the settings,
the compute device and the unit sizes, and the unit itself.

`prefetch_unit="auto"` (the default) copies whole layers on a GPU, as vLLM does: fewer,
larger copies suit a copy engine. On a CPU the device and the host are the same DRAM.
Where the slots plus the layer streaming in do not fit in the last-level cache, a whole
layer copied ahead has left the cache by the time it is read, so "auto" copies one weight
module at a time, `AUTO_MODULES_AHEAD` modules ahead, each landing just before it runs.
Where they fit, or where compute takes every core and copies run on the compute thread,
whole layers win: they need several times fewer hand-offs. The measurements behind both
rules are in docs/benchmarks.md.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from offload.config import PrefetchUnit
from offload.errors import ModelError
from offload.memory.disk_layout import DiskLayout
from offload.memory.host import HostSlab, TensorSpec, pack_offsets
from offload.memory.threads import available_cores

UNITS = tuple(PrefetchUnit)
AUTO_MODULES_AHEAD = 3


def resolve_unit(
    unit: str, device: torch.device, largest_layer: int = 0, prefetch_step: int = 1
) -> str:
    """The unit `unit` means on `device`: "auto" is layers on a GPU; on a CPU, modules
    when a copy thread runs beside compute (torch leaves a core free) and
    `prefetch_step` slots of the largest layer plus one more streaming in exceed the
    last-level cache, else layers (copies on the compute thread: fewer is faster)."""
    if unit != PrefetchUnit.AUTO:
        return PrefetchUnit(unit)
    if device.type != "cpu" or torch.get_num_threads() >= available_cores():
        return PrefetchUnit.LAYER
    spill = (prefetch_step + 1) * largest_layer > last_level_cache_bytes()
    return PrefetchUnit.MODULE if spill else PrefetchUnit.LAYER


_CACHE_SIZES = "/sys/devices/system/cpu/cpu0/cache"


@functools.cache
def last_level_cache_bytes() -> int:
    """The largest CPU cache (Linux sysfs); 0 where unknown, which means modules."""
    sizes = [0]
    for size in Path(_CACHE_SIZES).glob("index*/size"):
        try:
            text = size.read_text().strip().upper()
            scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
        except (OSError, ValueError):
            continue
    return max(sizes)


def units_ahead(
    unit: str, resolved: str, prefetch_step: int, unit_bytes: Sequence[int], layer_bytes: int
) -> int:
    """How many units ahead copies run (the number of device slots).

    With a unit chosen by the user, or "auto" resolved to layers, it is `prefetch_step`,
    counted in that unit, as vLLM counts layers. With "auto" resolved to modules,
    `prefetch_step` (in layers, vLLM's meaning) bounds the staging memory, `prefetch_step`
    x the largest layer, and copies run `AUTO_MODULES_AHEAD` modules ahead within that
    bound."""
    if unit != PrefetchUnit.AUTO or resolved != PrefetchUnit.MODULE or not unit_bytes:
        return prefetch_step
    largest = max(unit_bytes)
    fits = max(1, prefetch_step * layer_bytes // largest) if largest else AUTO_MODULES_AHEAD
    return min(AUTO_MODULES_AHEAD, fits)


def slab_bytes(sizes: Sequence[int]) -> int:
    """The bytes of a host slab (and so of a device slot) holding tensors of `sizes`."""
    return pack_offsets(sizes)[1]


@dataclass
class Unit:
    """What one prefetch copy brings in: a module's offloaded parameters, packed into one
    host slab, and (after `post_init`) views into the device slot it uses."""

    module: nn.Module
    name: str
    params: list[tuple[str, nn.Parameter]]
    specs: list[TensorSpec]
    layer_index: int  # the layer's place among the wrapped modules (for messages)
    slab: HostSlab | None = None
    address: int = 0  # where its first parameter lives in its slot (to catch replaced data)
    disk: DiskLayout | None = None  # streamed from the checkpoint's files instead of a slab
    mapped: bool = False  # on disk, computed on in place from a mapping of its file
    # Mapped and kept: its pages stay in the process between uses (else they leave it
    # once the unit has run, `MappedRead.release`: streamed units take no RSS).
    pages_held: bool = False

    @classmethod
    def of(cls, module: nn.Module, name: str, params: list, layer_index: int) -> Unit:
        return cls(module, name, params, [TensorSpec.of(p) for _, p in params], layer_index)

    @property
    def num_bytes(self) -> int:
        """The bytes of its slab (in host memory)."""
        return slab_bytes([spec.num_bytes for spec in self.specs])

    @property
    def slot_bytes(self) -> int:
        """What its device slot must hold: its slab, or its reads from disk (nothing when
        it is mapped)."""
        if self.mapped:
            return 0
        return self.disk.num_bytes if self.disk is not None else self.num_bytes

    def offsets(self) -> tuple[int, ...]:
        """Where each parameter starts in its slot."""
        return self.disk.tensor_offsets if self.disk is not None else self.slab.offsets

    def slot_views(self, slot: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's bytes in `slot` (uint8 views)."""
        offsets = self.offsets()
        return [slot[o : o + spec.num_bytes] for spec, o in zip(self.specs, offsets, strict=True)]

    def check_in_slot(self) -> None:
        """Its parameters still are the views of its slot that `post_init` made."""
        if self.params[0][1].data_ptr() != self.address:
            raise ModelError(
                f"the offloaded parameters of {self.name} no longer live in their device slot "
                "(model.to(), load_state_dict(assign=True) or .data replaced them); change dtype "
                "or device before offloading, and load weights with load_state_dict()"
            )

    def mark_overwritten(self) -> None:
        """Autograd may have saved its weights for a backward pass: mark them overwritten
        (each parameter has its own version counter, not the slot's)."""
        for _, param in self.params:
            torch.autograd.graph.increment_version(param)
