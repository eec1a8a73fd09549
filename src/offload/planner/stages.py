"""Pipeline parallel's stages: which contiguous run of decoder layers each rank holds.

Every rank's step waits for the slowest stage's, so the split minimizes the largest
stage's work. A stage's work is its weight bytes (a step reads each weight once) over the
rate its rank reads them from RAM at (`rates`, each rank's measured; equal where unknown),
and the bytes beyond its rank's RAM room (`rooms`: each rank's budget; None, no bound)
over the rate its disk reads at (`disk_rates`, measured; where unknown, `DISK_SLOWER`
times slower than its RAM): the last stage also reads the head. Pure arithmetic; `distributed/`
applies the split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from offload.errors import ConfigError

# How much slower a byte read from disk each step is than one read from RAM, where the
# split is not given measured rates: RAM 7-30 GB/s, an NVMe's O_DIRECT 1-7 GB/s.
DISK_SLOWER = 8.0


# Measured rates this close to their median are taken as equal: ranks alike measure a
# little apart from run to run (more so sharing a machine), and the split should not move.
SAME_WITHIN = 1.25


def steady(rates: Sequence[float | None]) -> list[float | None]:
    """`rates` with those within `SAME_WITHIN` of their median set to it (None kept)."""
    known = sorted(r for r in rates if r)
    if not known:
        return list(rates)
    median = known[len(known) // 2]
    return [median if r and 1 / SAME_WITHIN <= r / median <= SAME_WITHIN else r for r in rates]


@dataclass(frozen=True)
class Stage:
    """Rank `rank` of `size` holds decoder layers `layers` (rank 0 the embedding too, the
    last rank the head)."""

    rank: int
    size: int
    layers: range

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1


def split_layers(
    layer_bytes: Sequence[int],
    size: int,
    first_bytes: int = 0,
    last_bytes: int = 0,
    rates: Sequence[float] | None = None,
    rooms: Sequence[int | None] | None = None,
    disk_rates: Sequence[float | None] | None = None,
) -> list[range]:
    """`size` contiguous runs of the layers (each at least one), the largest stage's
    seconds (its bytes in RAM over its rank's rate, those beyond its rank's room over
    its disk's rate, else `DISK_SLOWER` times the RAM's time; `first_bytes` go with the
    first stage, `last_bytes` with the last) as small as it can be."""
    count = len(layer_bytes)
    if not 1 <= size <= count:
        raise ConfigError(
            f"pipeline_parallel_size must be between 1 and the model's {count} decoder "
            f"layers (one at least per stage), got {size}"
        )
    rates = list(rates) if rates is not None else [1.0] * size
    rooms = list(rooms) if rooms is not None else [None] * size
    disk_rates = list(disk_rates) if disk_rates is not None else [None] * size
    prefix = [0]
    for value in layer_bytes:
        prefix.append(prefix[-1] + value)

    def seconds(rank: int, start: int, end: int) -> float:
        work = prefix[end] - prefix[start]
        work += first_bytes if rank == 0 else 0
        work += last_bytes if rank == size - 1 else 0
        room, disk = rooms[rank], disk_rates[rank]
        beyond = work - room if room is not None and work > room else 0  # (read from disk)
        if beyond and disk:
            return (work - beyond) / rates[rank] + beyond / disk
        return (work + beyond * (DISK_SLOWER - 1)) / rates[rank]

    # best[r][e]: the least largest stage time of layers [0, e) on ranks [0, r]
    inf = float("inf")
    best = [[inf] * (count + 1) for _ in range(size)]
    cut = [[0] * (count + 1) for _ in range(size)]
    for end in range(1, count + 1):
        best[0][end] = seconds(0, 0, end)
    for rank in range(1, size):
        for end in range(rank + 1, count + 1):
            for start in range(rank, end):
                value = max(best[rank - 1][start], seconds(rank, start, end))
                if value < best[rank][end]:
                    best[rank][end], cut[rank][end] = value, start
    ends, end = [], count
    for rank in range(size - 1, 0, -1):
        ends.append(end)
        end = cut[rank][end]
    ends.append(end)
    bounds = [0, *reversed(ends)]
    return [range(bounds[i], bounds[i + 1]) for i in range(size)]


@dataclass(frozen=True)
class StageEstimate:
    """A stage's weights, those its rank streams from disk, and a step of it."""

    stage: Stage
    weight_bytes: int
    streamed_bytes: int
    step_s: float


def estimate_stages(
    layer_bytes: Sequence[int],
    head_bytes: int,
    size: int,
    room_bytes: int | None,
    ram_gb_per_s: float,
    disk_gb_per_s: float | None,
    compute_s: float = 0.0,
    kv_bytes: int = 0,
) -> list[StageEstimate]:
    """Each rank's stage (`split_layers`) and its step: the longer of its share of the
    whole model's compute (`compute_s`, by bytes) and its reads (its bytes in RAM over the
    RAM read rate, those beyond its room over the disk's). A rank's room: `room_bytes`
    (each rank's budget less what is not weights; None: every weight fits) less its
    layers' share of the KV cache (`kv_bytes`, the whole stack's). The split is the one
    ranks of this machine's rates and `room_bytes` each would choose."""
    estimates, total = [], sum(layer_bytes) + head_bytes
    rates, disks, rooms = [ram_gb_per_s] * size, [disk_gb_per_s] * size, [room_bytes] * size
    stages = split_layers(layer_bytes, size, 0, head_bytes, rates, rooms, disks)
    for rank, layers in enumerate(stages):
        weight = sum(layer_bytes[i] for i in layers) + (head_bytes if rank == size - 1 else 0)
        streamed = 0
        if room_bytes is not None:
            room = room_bytes - kv_bytes * len(layers) // len(layer_bytes)
            streamed = min(weight, max(0, weight - room))
        reads = (weight - streamed) / (ram_gb_per_s * 1e9)
        if streamed:
            reads += streamed / ((disk_gb_per_s or ram_gb_per_s) * 1e9)
        seconds = max(reads, compute_s * weight / total)
        estimates.append(StageEstimate(Stage(rank, size, layers), weight, streamed, seconds))
    return estimates
