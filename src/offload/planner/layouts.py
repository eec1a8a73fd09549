"""The placements the planner weighs: every layer resident; vLLM's prefetch pattern (the
last `num_in_group` of every `group_size` layers offloaded, `prefetch_step` slots), with
what exceeds the host budget on disk (the disk tier); and UVA of the first layers' weights
(or of the experts alone). Each is a `Layout`: where each layer lives, the bytes that
leave the device, and the config that puts them there. Pure functions of the sizes."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from offload.config import (
    DiskOffloadConfig,
    OffloadConfig,
    PrefetchOffloadConfig,
    UVAOffloadConfig,
)
from offload.memory.placement import DiskIO, Placement
from offload.memory.slots import num_slots, slot_sizes
from offload.offloader.disk_placement import place_on_disk
from offload.offloader.selection import offloaded_layer_indices
from offload.planner.shape import EXPERTS, ModelShape
from offload.sizes import GIB

MAX_PREFETCH_STEP = 4
_READ_AHEAD = DiskOffloadConfig().read_ahead


@dataclass(frozen=True)
class Layout:
    """Where each layer's weights live, the device slots and their bytes, the weights
    kept in host memory, and the config that does it."""

    config: OffloadConfig
    places: tuple[Placement, ...]  # per layer, see `cost.PLACES`
    off_bytes: tuple[int, ...]  # per layer, the bytes off the device
    prefetch_step: int  # the slots (raised to read_ahead + 1 where layers are on disk)
    staging_bytes: int
    host_bytes: int
    label: str
    experts_only: bool = False

    @property
    def offloaded_bytes(self) -> int:
        return sum(self.off_bytes)

    @property
    def disk_bytes(self) -> int:
        return sum(
            b for p, b in zip(self.places, self.off_bytes, strict=True) if p != Placement.HOST
        )


def resident(shape: ModelShape) -> Layout:
    count = shape.num_layers
    places = (Placement.RESIDENT,) * count
    return Layout(OffloadConfig(), places, (0,) * count, 1, 0, 0, "resident")


def prefetch_layouts(shape: ModelShape, host_budget_bytes: int, disk_io: DiskIO) -> list[Layout]:
    """A prefetch layout for each number of layers vLLM's pattern can offload (the pattern
    that spreads them most) and each step up to `MAX_PREFETCH_STEP`, where the slots take
    less device memory than the layers leave; offloaded layers beyond the host budget
    stream from disk with `disk_io` (MMAP: computed on in place)."""
    found: dict[tuple, Layout] = {}
    for group, num in spread_patterns(shape.num_layers):
        for step in range(1, MAX_PREFETCH_STEP + 1):
            layout = prefetch(shape, group, num, step, host_budget_bytes, disk_io)
            if layout.staging_bytes < layout.offloaded_bytes:  # else no device byte saved
                found.setdefault((layout.places, layout.prefetch_step), layout)
    return list(found.values())


def prefetch_layouts_within(
    shape: ModelShape, room_bytes: int, disk_io: DiskIO, budget_gb: float
) -> list[Layout]:
    """`prefetch_layouts` on a CPU's one budget: each keeps in RAM the offloaded layers
    that `room_bytes` (the budget less the KV cache and activations) holds beside its
    layers not offloaded and its slots (see `prefetch_within`)."""
    found: dict[tuple, Layout] = {}
    for group, num in spread_patterns(shape.num_layers):
        for step in range(1, MAX_PREFETCH_STEP + 1):
            layout = prefetch_within(shape, group, num, step, room_bytes, disk_io, budget_gb)
            if layout.staging_bytes < layout.offloaded_bytes:  # else no byte saved
                found.setdefault((layout.places, layout.prefetch_step, layout.host_bytes), layout)
    return list(found.values())


def prefetch_within(
    shape: ModelShape,
    group: int,
    num: int,
    step: int,
    room_bytes: int,
    disk_io: DiskIO,
    budget_gb: float,
) -> Layout:
    """vLLM's pattern with `step` slots, keeping in RAM the offloaded layers that fit in
    `room_bytes` beside the layers not offloaded and the slots; the others are read from
    disk. Its config carries the budget itself (`budget_gb`, as `--cpu-memory-gb` says it
    to the run, which takes the KV cache and activations out of it) and `disk_io`."""
    every = sum(shape.layer_bytes)
    whole = prefetch(shape, group, num, step, every, disk_io)  # nothing on disk
    resident_bytes = every - whole.offloaded_bytes
    keep = room_bytes - resident_bytes - whole.staging_bytes
    if keep < whole.offloaded_bytes:  # some on disk: the slots of the disk's read-ahead
        streamed = prefetch(shape, group, num, step, 0, disk_io)
        keep = max(0, room_bytes - resident_bytes - streamed.staging_bytes)
    layout = prefetch(shape, group, num, step, keep, disk_io)
    disk = DiskOffloadConfig(cpu_memory_gb=budget_gb, disk_io=disk_io)
    return replace(layout, config=replace(layout.config, disk=disk))


def spread_patterns(num_layers: int) -> list[tuple[int, int]]:
    """(group size, number in group) for each count of offloaded layers the pattern can
    give: the smallest group that gives it, whose offloaded layers are the most spread
    (so that each copy has the most compute before it to hide behind)."""
    found: dict[int, tuple[int, int]] = {}
    for group in range(1, num_layers + 1):
        for num in range(1, group + 1):
            # offloaded_layer_indices's count: `num` of each whole group, and the tail of
            # a partial one.
            count = num_layers // group * num + max(0, num_layers % group - (group - num))
            found.setdefault(count, (group, num))
    return sorted(found.values(), key=lambda pattern: pattern[1] / pattern[0])


def prefetch(
    shape: ModelShape, group: int, num: int, step: int, host_budget_bytes: int, disk_io: DiskIO
) -> Layout:
    """vLLM's pattern with `step` slots; the disk tier takes what the host budget cannot."""
    indices = offloaded_layer_indices(shape.num_layers, group, num)
    sizes = [shape.layer_bytes[i] for i in indices]
    disk = DiskOffloadConfig()
    on_disk = [False] * len(sizes)
    if sum(sizes) > host_budget_bytes:
        cpu_memory_gb = hundredths(max(0, host_budget_bytes) / GIB, math.floor)
        disk = DiskOffloadConfig(cpu_memory_gb=cpu_memory_gb, disk_io=disk_io)
        on_disk = place_on_disk(sizes, int(cpu_memory_gb * GIB))
    # Layers read from disk need read_ahead + 1 slots (the offloader raises the step).
    slots = max(step, _READ_AHEAD + 1) if any(on_disk) else step
    places, off = [Placement.RESIDENT] * shape.num_layers, [0] * shape.num_layers
    streamed = Placement.MAPPED if disk_io == DiskIO.MMAP else Placement.DISK
    for index, size, disk_layer in zip(indices, sizes, on_disk, strict=True):
        places[index], off[index] = streamed if disk_layer else Placement.HOST, size
    config = OffloadConfig(
        offload_backend="prefetch",
        prefetch=PrefetchOffloadConfig(
            offload_group_size=group, offload_num_in_group=num, offload_prefetch_step=step
        ),
        disk=disk,
    )
    kept = sum(s for s, d in zip(sizes, on_disk, strict=True) if not d)
    return Layout(
        config,
        tuple(places),
        tuple(off),
        slots,
        sum(slot_sizes(sizes, num_slots(len(sizes), slots))),
        kept,
        _prefetch_label(group, num, slots, len(indices), sum(on_disk), disk_io),
    )


def hundredths(gib: float, rounding) -> float:
    """`gib` rounded (math.floor or math.ceil) to 0.01 GiB, as flags write it; a hair of
    float error (0.1 GiB in bytes and back) does not cost a hundredth."""
    return rounding(round(gib * 100, 6)) / 100


def _prefetch_label(group: int, num: int, slots: int, count: int, on_disk: int, io: DiskIO) -> str:
    text = f"prefetch {num} of every {_count(group, 'layer')} ({_count(count, 'layer')}), "
    text += _count(slots, "slot")
    if on_disk:
        text += f", {on_disk} of them {'mapped from' if io == DiskIO.MMAP else 'read from'} disk"
    return text


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def uva(shape: ModelShape, needed_bytes: int, experts_only: bool = False) -> Layout | None:
    """UVA of the least that frees `needed_bytes` (0.01 GiB steps): the layers' weights in
    order (vLLM's rule), or their experts only. None when not even all of them do."""
    eligible = shape.expert_bytes if experts_only else shape.layer_bytes
    if needed_bytes > sum(eligible) or needed_bytes <= 0:
        return None
    cpu_offload_gb = hundredths(needed_bytes / GIB, math.ceil)
    remaining, off = int(cpu_offload_gb * GIB), []
    for size in eligible:  # whole layers in order; the last one in part
        off.append(min(size, max(0, remaining)))
        remaining -= size
    config = OffloadConfig(
        offload_backend="uva",
        uva=UVAOffloadConfig(
            cpu_offload_gb=cpu_offload_gb, cpu_offload_params={EXPERTS} if experts_only else set()
        ),
    )
    places = tuple(Placement.UVA if b else Placement.RESIDENT for b in off)
    what = "experts" if experts_only else "weights"
    label = (
        f"UVA of {cpu_offload_gb:g} GiB of layer {what} ({_count(sum(map(bool, off)), 'layer')})"
    )
    return Layout(config, places, tuple(off), 1, 0, sum(off), label, experts_only)
