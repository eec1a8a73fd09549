"""CPU threads when the CPU both computes and copies: how many cores there are (a copy
thread runs only where compute leaves one free; see `make_copy_engine`), and advice about
OpenMP's spinning workers only when they are measured to slow the copies.

The library never changes torch's thread count itself: a matrix product on fewer threads
sums in another order, so its float results differ (docs/benchmarks.md), and offloading
must not change a bit of the output.
"""

from __future__ import annotations

import logging
import os

import torch

from offload.errors import OffloadError

_logger = logging.getLogger("offload")


def check_not_forked(owner_pid: int, what: str) -> None:
    """Refuse to run `what`, made by process `owner_pid`, in a child that `os.fork()`
    made from it: the copy, read and torch worker threads it waits on did not come along,
    so it would hang. One clear error instead, before anything runs."""
    if os.getpid() != owner_pid:
        raise OffloadError(
            f"{what} was loaded by process {owner_pid}, and this process is a fork of it: "
            "its threads did not come along; load the model in this process, or start "
            "workers with multiprocessing's 'spawn' method"
        )


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


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
        "idle: OpenMP threads spinning between parallel regions take its core; try starting "
        "Python with OMP_WAIT_POLICY=PASSIVE (it slows compute itself on some hosts: compare)",
        busy_gb_per_s,
        idle_gb_per_s,
    )
    return True
