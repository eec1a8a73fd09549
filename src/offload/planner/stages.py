"""Pipeline parallel's stages: which contiguous run of decoder layers each rank holds.

Every rank's step waits for the slowest stage's, so the split minimizes the largest
stage's work. A stage's work is its weight bytes (a step reads each weight once) over the
rate its rank reads them at (`rates`: RAM, the link, the disk; equal where unknown): the
first stage also holds the embedding, the last the final norm and head. Pure arithmetic;
`distributed/` applies the split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from offload.errors import ConfigError


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
) -> list[range]:
    """`size` contiguous runs of the layers (each at least one), the largest stage's
    seconds (its bytes over its rank's rate; `first_bytes` go with the first stage,
    `last_bytes` with the last) as small as it can be."""
    count = len(layer_bytes)
    if not 1 <= size <= count:
        raise ConfigError(
            f"pipeline_parallel_size must be between 1 and the model's {count} decoder "
            f"layers (one at least per stage), got {size}"
        )
    rates = list(rates) if rates is not None else [1.0] * size
    prefix = [0]
    for value in layer_bytes:
        prefix.append(prefix[-1] + value)

    def seconds(rank: int, start: int, end: int) -> float:
        work = prefix[end] - prefix[start]
        work += first_bytes if rank == 0 else 0
        work += last_bytes if rank == size - 1 else 0
        return work / rates[rank]

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
