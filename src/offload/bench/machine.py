"""Timing with the device synchronised, and where a result is saved: every result file
says its machine and date (`probes.host.machine()`)."""

from __future__ import annotations

import datetime
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from offload.memory.device import synchronize
from offload.probes.host import machine


def median_seconds(
    fn: Callable[[], object], device: torch.device, warmup: int, repeats: int
) -> float:
    """Median wall time of `fn` after `warmup` untimed calls, synchronising the device
    before and after each timed call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def save_json(folder: Path, name: str, device: torch.device, payload: dict[str, object]) -> Path:
    """`payload` with the machine and date, as `<name>-<device type>-<UTC stamp>.json` in
    `folder` (made if missing)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{device.type}-{stamp()}.json"
    path.write_text(json.dumps({"machine": machine(device), **payload}, indent=2) + "\n")
    return path


def stamp() -> str:
    """The UTC time now, as result files name it (20261125-031500)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
