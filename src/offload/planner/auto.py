"""What `LLM` runs when the offloading is left to it: `cpu_offload_gb="auto"` with
`offload_backend="auto"` and no prefetch layout, so that only memory budgets are given
(the device's, and `cpu_memory_gb` for host memory). The planner ranks the placements
for one sequence at the engine's context length, from this machine's measurements
(cached, see `measure.py`); the engine takes the first that its own memory check passes.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from offload.config import DISK_IO, OffloadConfig
from offload.planner.choose import candidates
from offload.planner.measure import MeasureSettings, measure
from offload.planner.plan import budgets_for
from offload.planner.shape import shape_of


def wants_plan(config: OffloadConfig) -> bool:
    """Whether `config` leaves backend and layout to the planner (a budget only)."""
    return (
        config.uva.cpu_offload_gb == "auto"
        and config.offload_backend == "auto"
        and config.prefetch.offload_group_size == 0
    )


def planned_configs(
    path: Path,
    empty: nn.Module,
    config: OffloadConfig,
    device: torch.device,
    *,
    context_len: int,
    gpu_memory_utilization: float,
    device_memory_gb: float | None,
    kv_offload: bool,
    trust_remote_code: bool = False,
) -> list[OffloadConfig]:
    """`config` with each placement the planner finds for `empty` (built on the meta device
    from `path`) at batch 1 and `context_len`, fastest first; the KV cache where
    `kv_offload` puts it. A UVA placement asks the engine for its smallest amount
    ("auto"): the engine counts memory to the byte."""
    shape = shape_of(empty, context_len)
    host_gb = config.disk.cpu_memory_gb if config.disk.is_active else None
    budgets = budgets_for(device, gpu_memory_utilization, device_memory_gb, host_gb)
    # The probes stay within the device budget (a capped process must not run out).
    settings = MeasureSettings(max_device_bytes=budgets.device_bytes)
    measured = measure(
        path,
        shape,
        device,
        [1],
        context_len,
        settings=settings,
        trust_remote_code=trust_remote_code,
    )
    modes = DISK_IO if config.disk.disk_io == "auto" else (config.disk.disk_io,)
    found = candidates(shape, measured.measurements, budgets, [1], modes, kv_given=kv_offload)
    merged: list[OffloadConfig] = []
    for candidate in found:  # the first of equal configs only
        planned = _merged(config, candidate.layout.config)
        if planned not in merged:
            merged.append(planned)
    return merged


def _merged(user: OffloadConfig, planned: OffloadConfig) -> OffloadConfig:
    """The planned placement with the user's other settings (pinning, prefetch unit, disk
    folder, threads and way of reading)."""
    backend = planned.selected_backend
    uva = planned.uva
    if backend == "uva" and not uva.cpu_offload_params:
        uva = replace(uva, cpu_offload_gb="auto")
    # The host budget (the user's cpu_memory_gb) is met by the plan: the disk tier is on
    # only where the plan puts layers on disk.
    disk = replace(user.disk, cpu_memory_gb=planned.disk.cpu_memory_gb)
    return replace(
        user,
        offload_backend="auto" if backend == "none" else backend,
        uva=uva,
        prefetch=planned.prefetch,
        disk=disk,
    )
