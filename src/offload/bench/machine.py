"""Timing with the device synchronised, what machine a result came from, and where it is
saved: every result file says its machine and date (`machine()` fields)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from offload.offloader.units import last_level_cache_bytes


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def machine(device: torch.device) -> dict[str, object]:
    info: dict[str, object] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "cpu_model": _cpu_model(),
        # Decides the CPU's prefetch unit; two hosts of this VM differed 15x.
        "last_level_cache_bytes": last_level_cache_bytes(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


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
