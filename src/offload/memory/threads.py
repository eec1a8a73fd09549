"""CPU threads when the CPU both computes and copies: a core for the copy thread, and
advice about OpenMP's spinning workers only when they are measured to slow the copies.

Measured on 2 cores, SmolLM2 decode with every layer prefetched (docs/benchmarks.md):
compute on every core leaves the copy thread to fight for one, and OpenMP workers that
spin between parallel regions (its default wait policy) take that core outright: 0.60x
resident spinning, 0.83-0.85x with `OMP_WAIT_POLICY=PASSIVE`, and 0.95-1.07x with module
units and one compute thread fewer than the cores.
"""

from __future__ import annotations

import logging
import os

import torch

_logger = logging.getLogger("offload")


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


class SpareCore:
    """During a forward, compute on one thread fewer than the cores, so the copy thread
    has one of its own; the caller's thread count is restored after it. A count the user
    already set below the cores is theirs and is left alone, as is a single core."""

    def __init__(self) -> None:
        self._saved: int | None = None

    def enter(self) -> None:
        threads = torch.get_num_threads()
        if self._saved is None and threads > 1 and threads >= available_cores():
            self._saved = threads
            torch.set_num_threads(threads - 1)

    def exit(self) -> None:
        """Give the caller its thread count back (also after an interrupted forward)."""
        if self._saved is not None:
            saved, self._saved = self._saved, None
            torch.set_num_threads(saved)


# The copy thread's rate during forwards below this share of its rate with compute idle
# means something takes its core; spinning OpenMP workers are the usual cause.
SLOW_SHARE = 0.5


def spin_hurts(idle_gb_per_s: float, busy_gb_per_s: float, wait_policy: str, threads: int) -> bool:
    """Whether OpenMP's spinning workers are measured to slow the copy thread: copies
    during forwards run at under `SLOW_SHARE` of their rate with compute idle, while
    OpenMP may spin (its wait policy is not PASSIVE) with more than one compute thread."""
    if wait_policy.strip().upper() == "PASSIVE" or threads <= 1 or idle_gb_per_s <= 0:
        return False
    return busy_gb_per_s < SLOW_SHARE * idle_gb_per_s


def advise_passive_wait_policy(idle_gb_per_s: float, busy_gb_per_s: float) -> bool:
    """Log the one-line advice when `spin_hurts`; returns whether it did."""
    policy = os.environ.get("OMP_WAIT_POLICY", "")
    if not spin_hurts(idle_gb_per_s, busy_gb_per_s, policy, torch.get_num_threads()):
        return False
    _logger.warning(
        "offload: the CPU copy thread moves %.1f GB/s during forwards, %.1f GB/s with compute "
        "idle: OpenMP threads spinning between parallel regions take its core; start Python "
        "with OMP_WAIT_POLICY=PASSIVE (the offload command does)",
        busy_gb_per_s,
        idle_gb_per_s,
    )
    return True
