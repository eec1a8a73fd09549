"""Which offloaded units stay in host memory and which stream from disk: a pure function
of their sizes and the host budget.

Every offloaded unit is brought in once per forward, from RAM or from disk, so the bytes
read from disk per forward are the bytes of the units not kept in RAM: keeping the set of
units whose sizes fill the budget best makes them the fewest (a subset sum, solved
exactly in a grain that keeps the table of sums small: the sizes' common divisor, or a
millionth of the budget with sizes rounded up, so the budget always holds). Among units of
one size, those kept in RAM are spread evenly over the forward, so that every disk read
has the compute of RAM units before it to hide behind.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from offload.errors import ModelError
from offload.memory.placement import DiskIO
from offload.memory.slots import slot_of

MAX_GRAINS = 2**20  # the budget in at most this many grains
IO_CHOICES = tuple(DiskIO)
AUTO_MAP_CACHED = 0.9  # share of the streamed bytes in the page cache for "auto" to map them
# "auto" maps a cold checkpoint too where its streamed bytes fit this share of the RAM
# available: after the first forward the page cache holds them (the kernel's memory, not
# the process's), and later forwards compute on them in place: a cold checkpoint mapped
# decoded several times as fast as one read directly (docs/benchmarks.md).
AUTO_CACHE_SHARE = 0.5


def grain_for(budget_bytes: int, sizes: Sequence[int] = ()) -> int:
    """What sizes and the budget are counted in (sizes rounded up: the budget holds): the
    sizes' common divisor where that keeps the table small (exact: equal layers fill the
    budget to the byte), else a millionth of the budget."""
    common = math.gcd(*sizes) if sizes else 0
    if common and budget_bytes // common <= MAX_GRAINS:
        return common
    return max(1, -(-budget_bytes // MAX_GRAINS))


def place_on_disk(sizes: Sequence[int], budget_bytes: int) -> list[bool]:
    """For units of `sizes` bytes (in forward order), whether each streams from disk;
    the others stay in host memory, and their sizes add up to at most `budget_bytes`."""
    if budget_bytes <= 0 or not sizes:
        return [True] * len(sizes)
    if sum(sizes) <= budget_bytes:
        return [False] * len(sizes)
    grain = grain_for(budget_bytes, sizes)
    grains = [-(-size // grain) for size in sizes]
    kept = _best_subset(grains, budget_bytes // grain)
    counts: dict[int, int] = {}
    for index in kept:
        counts[sizes[index]] = counts.get(sizes[index], 0) + 1
    on_disk = [True] * len(sizes)
    for size, count in counts.items():
        members = [i for i, s in enumerate(sizes) if s == size]
        for index in _spread(len(members), count):
            on_disk[members[index]] = False
    return on_disk


def _best_subset(weights: Sequence[int], capacity: int) -> list[int]:
    """Indices of a subset of `weights` with the largest sum not above `capacity`
    (reachable sums as the bits of an integer, one shift per item)."""
    mask = (1 << (capacity + 1)) - 1
    reachable = [1]  # after i items: bit s set <=> some subset of the first i sums to s
    for weight in weights:
        reachable.append((reachable[-1] | (reachable[-1] << weight)) & mask)
    total = reachable[-1].bit_length() - 1
    chosen = []
    for i in range(len(weights), 0, -1):  # walk back: was item i-1 needed to reach total?
        if not (reachable[i - 1] >> total) & 1:
            chosen.append(i - 1)
            total -= weights[i - 1]
    return sorted(chosen)


def _spread(num_items: int, count: int) -> list[int]:
    """`count` of `num_items` positions, evenly spaced (the last one always included,
    so that a single RAM unit gives the first disk read of the next forward time)."""
    if count <= 0:
        return []
    return sorted({num_items - 1 - (k * num_items) // count for k in range(count)})


def choose_io(
    requested: DiskIO,
    device: torch.device,
    cached_fraction: float,
    can_map: bool = True,
    fits_page_cache: bool = False,
) -> DiskIO:
    """How units on disk are read, "auto" resolved: on the CPU, a checkpoint whose
    streamed bytes are (nearly) all in the page cache already, or fit it
    (`fits_page_cache`: within `AUTO_CACHE_SHARE` of the RAM available), is mapped and
    computed from in place (no copy, and no memory the cache does not hold anyway);
    otherwise direct reads, which keep the page cache out of a model larger than it can
    hold. A GPU always reads (into pinned staging). `can_map`: this system can guard a
    mapping (file leases) and the weights start where compute needs them in the files
    (else a checkpoint the cache holds or will hold is read through it)."""
    if requested not in IO_CHOICES:
        raise ModelError(f"disk io must be one of {', '.join(IO_CHOICES)}, got {requested!r}")
    requested = DiskIO(requested)
    if requested == DiskIO.MMAP and device.type != "cpu":
        raise ModelError(
            f"disk_io='mmap' computes on mapped files and needs the CPU as compute device, "
            f"not {device.type}: use 'direct' or 'page-cache'"
        )
    if requested != DiskIO.AUTO:
        return requested
    if device.type == "cpu" and (cached_fraction >= AUTO_MAP_CACHED or fits_page_cache):
        return DiskIO.MMAP if can_map else DiskIO.PAGE_CACHE
    return DiskIO.DIRECT


class StackRoomError(ModelError):
    """The RAM a process budget leaves the layer stack is less than streaming needs."""

    def __init__(self, message: str, need_bytes: int, room_bytes: int):
        super().__init__(message)
        self.need_bytes = need_bytes
        self.room_bytes = room_bytes


@dataclass(frozen=True)
class StackFit:
    """How a layer stack takes the RAM a process budget leaves it (`fit_stack`)."""

    io: DiskIO  # MMAP, or a way of reading
    in_ram: list[bool]  # per unit: kept (a host slab, or its mapped pages held)
    ram_bytes: int  # the most RAM the stack takes at once


def fit_stack(
    unit_bytes: Sequence[int],
    slot_bytes: Sequence[int],
    movable: Sequence[int],
    room_bytes: int,
    num_slots: int,
    io: DiskIO,
    asked: bool,
) -> StackFit:
    """Which units stay in RAM when the whole stack must fit `room_bytes`: kept units,
    the slot ring, and the pages of mapped files that a forward touches all count (they
    are all in the process's RSS). `unit_bytes`/`slot_bytes`: each unit's bytes in RAM and
    in a slot, in forward order; `movable`: the units that can stream (the others stay
    in RAM whatever the budget). With `io` MMAP, units stream from the mapping and each
    one's pages leave the process after it runs, so streaming takes one unit's pages
    (the window), not a slot ring; kept units are mapped with their pages held. Where
    the window does not fit, an "auto" choice (`asked` False) reads instead. Raises
    `StackRoomError` when the room holds not even what streaming needs."""
    streams = set(movable)
    fixed = [i for i in range(len(unit_bytes)) if i not in streams]
    if io == DiskIO.MMAP:
        fixed_slots = _ring_bytes(slot_bytes, fixed, num_slots)
        window = max((unit_bytes[i] for i in movable), default=0)
        need = sum(unit_bytes[i] for i in fixed) + fixed_slots + window
        if need <= room_bytes or asked:
            mapped = f"the largest layer's mapped pages, {_mib(window)}"
            _check_room(need, room_bytes, mapped, "disk_io='mmap': " if asked else "")
            return _kept(unit_bytes, movable, room_bytes - need, DiskIO.MMAP, need, window)
        io = DiskIO.DIRECT
    slots = _ring_bytes(slot_bytes, range(len(unit_bytes)), num_slots)
    need = sum(unit_bytes[i] for i in fixed) + slots
    _check_room(need, room_bytes, f"{min(num_slots, len(unit_bytes))} slots, {_mib(slots)}")
    return _kept(unit_bytes, movable, room_bytes - need, io, need, 0)


def _kept(
    unit_bytes: Sequence[int], movable: Sequence[int], free: int, io: DiskIO, need: int, window: int
) -> StackFit:
    """Movable units kept in the `free` bytes (all of them: no window either)."""
    sizes = [unit_bytes[i] for i in movable]
    if sum(sizes) <= free + window:
        on_disk, need = [False] * len(sizes), need - window
    else:
        on_disk = place_on_disk(sizes, free)
    in_ram = [True] * len(unit_bytes)
    for index, disk in zip(movable, on_disk, strict=True):
        in_ram[index] = not disk
    kept = sum(size for size, disk in zip(sizes, on_disk, strict=True) if not disk)
    return StackFit(io, in_ram, need + kept)


def _ring_bytes(slot_bytes: Sequence[int], users: Sequence[int], num_slots: int) -> int:
    """The slots that `users` (unit indices, in forward order) are copied or read into."""
    slots = min(num_slots, len(slot_bytes))
    if not users or not slots:
        return 0
    sizes = [0] * slots
    for index in users:
        slot = slot_of(index, slots)
        sizes[slot] = max(sizes[slot], slot_bytes[index])
    return sum(sizes)


def _check_room(need: int, room_bytes: int, streaming: str, asked: str = "") -> None:
    if need > room_bytes:
        raise StackRoomError(
            f"{asked}the layer stack needs at least {_mib(need)} of RAM to stream ({streaming}), "
            f"more than the {_mib(max(room_bytes, 0))} the budget leaves it",
            need,
            room_bytes,
        )


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.0f} MiB"
