"""What one prefetch copy brings in, and how far ahead: pure functions of the settings,
the compute device and the unit sizes.

`prefetch_unit="auto"` (the default) copies whole layers on a GPU, as vLLM does: fewer,
larger copies suit a copy engine. On a CPU the device and the host are the same DRAM and a
whole layer copied a layer ahead has left the cache by the time it is read, so it copies
one weight module at a time, `AUTO_MODULES_AHEAD` modules ahead, each landing just before
it runs (measured on 2 cores, SmolLM2 decode with every layer offloaded: whole layers
0.79-0.88x resident, modules 2 / 3 / 4 ahead 0.95 / 1.06 / 1.05x; docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from offload.memory.host import pack_offsets

UNITS = ("auto", "layer", "module")
AUTO_MODULES_AHEAD = 3


def resolve_unit(unit: str, device: torch.device) -> str:
    """The unit `unit` means on `device`: "auto" is modules on a CPU, layers elsewhere."""
    if unit != "auto":
        return unit
    return "module" if device.type == "cpu" else "layer"


def units_ahead(unit: str, prefetch_step: int, unit_bytes: Sequence[int], layer_bytes: int) -> int:
    """How many units ahead copies run (the number of device slots).

    With a unit chosen by the user it is `prefetch_step`, counted in that unit, as vLLM
    counts layers. With "auto" resolved to modules, `prefetch_step` (in layers, vLLM's
    meaning) bounds the staging memory, `prefetch_step` x the largest layer, and copies
    run `AUTO_MODULES_AHEAD` modules ahead within that bound."""
    if unit != "auto" or not unit_bytes:
        return prefetch_step
    largest = max(unit_bytes)
    fits = max(1, prefetch_step * layer_bytes // largest) if largest else AUTO_MODULES_AHEAD
    return min(AUTO_MODULES_AHEAD, fits)


def slab_bytes(sizes: Sequence[int]) -> int:
    """The bytes of a host slab (and so of a device slot) holding tensors of `sizes`."""
    return pack_offsets(sizes)[1]
