"""The bound of one forward step: pure arithmetic over measured figures.

A step cannot be faster than its compute, nor than the time each link it uses needs for
the bytes it moves over that link per step. With copies overlapping compute (prefetch) the
step approaches the largest of these; `step / bound` says how far a method is from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from offload.memory.placement import Link

# The links a method's bytes cross, each with the machine figure that bounds it.
LINKS = {
    Link.MEMCPY: "host memory copy",
    Link.DISK: "sequential disk read (O_DIRECT)",
    Link.PAGE_CACHE: "read of file pages in the page cache",
    Link.H2D_PINNED: "host to device, from pinned memory",
    Link.H2D_PAGEABLE: "host to device, from pageable memory",
}
COMPUTE = "compute"


@dataclass(frozen=True)
class Bound:
    """`step_s`: max(compute, each link's bytes / its bandwidth); `limit`: what sets it
    ("compute" or a link); `link_s`: each link's time per step."""

    step_s: float | None
    limit: str
    link_s: dict[str, float]


def bound_step(
    compute_s: float | None,
    moved_bytes: Mapping[str, float],
    gb_per_s: Mapping[str, float | None],
) -> Bound:
    """The bound of a step that computes for `compute_s` (None: unknown) and moves
    `moved_bytes[link]` bytes over each link, whose bandwidth is `gb_per_s[link]` GB/s
    (1e9 bytes; None: not measured on this machine, so that link is left out)."""
    unknown = set(moved_bytes) - set(LINKS)
    if unknown:
        raise ValueError(f"moved_bytes names links {sorted(unknown)}; known: {', '.join(LINKS)}")
    link_s = {
        link: num_bytes / (gb_per_s[link] * 1e9)
        for link, num_bytes in moved_bytes.items()
        if num_bytes > 0 and gb_per_s.get(link)
    }
    slowest = max(link_s, key=link_s.__getitem__, default=None)
    if slowest is None or (compute_s is not None and compute_s >= link_s[slowest]):
        return Bound(compute_s, COMPUTE, link_s)
    return Bound(link_s[slowest], slowest, link_s)


def step_over_bound(step_s: float, bound_s: float | None) -> float | None:
    """How many times its bound a measured step takes (1.0: at the bound)."""
    return step_s / bound_s if bound_s else None
