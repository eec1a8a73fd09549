"""Measure, then decide: what `LLM` (and `offload inspect`) run when the offloading is left
to them, `cpu_offload_gb="auto"` with `offload_backend="auto"` and no prefetch layout, so
that only memory budgets are given (the device's, and `cpu_memory_gb` for host memory):
the planner ranks the placements for one sequence at the engine's context length, from
this machine's measurements (`offload.probes`, cached), and the first that the memory check
(`llm.fit.plan_memory`) passes runs. `plan_for` is `offload plan`'s entry point.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offload.config import DISK_IO, Backend, OffloadConfig
from offload.config.limits import DEFAULT_CONTEXT_LEN, DEFAULT_MAX_BATCH, GPU_MEMORY_UTILIZATION
from offload.engine import cpu_step
from offload.llm.budget import MIN_FITTED_LEN, shorter_power_of_two
from offload.llm.fit import MemoryPlan, plan_memory
from offload.llm.spec import ModelSpec, model_spec
from offload.memory.placement import AUTO, DiskIO
from offload.planner.choose import Budgets, candidates, fits_at_all
from offload.planner.fit import checked_context_len, model_len_limit
from offload.planner.overhead import fixed_overhead
from offload.planner.plan import (
    Plan,
    batch_sizes_for,
    budgets_for,
    make_plan,
    measurable_batches,
)
from offload.planner.shape import shape_of
from offload.probes.measure import measure
from offload.probes.settings import DEFAULT_SETTINGS, MeasureSettings

_logger = logging.getLogger(__name__)


def wants_plan(config: OffloadConfig) -> bool:
    """Whether `config` leaves backend and layout to the planner (a budget only)."""
    return (
        config.uva.cpu_offload_gb == AUTO
        and config.offload_backend == Backend.AUTO
        and config.prefetch.offload_group_size == 0
    )


def planned_memory(
    llm: Any,
    path: Path,
    empty: nn.Module,
    config: OffloadConfig,
    max_model_len: int | None,
    gpu_memory_utilization: float,
    device_memory_gb: float | None,
) -> MemoryPlan:
    """`plan_memory` for an `LLM` being made (its device and engine settings), with the
    planner's choices first where it has a budget (`planner_for`)."""
    return plan_memory(
        empty,
        config,
        llm.device,
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        device_memory_gb=device_memory_gb,
        max_num_batched_tokens=llm.max_num_batched_tokens,
        kv_offload=llm.kv_offload,
        swap_space_bytes=llm.swap_space_bytes,
        planned=planner_for(
            path,
            empty,
            config,
            llm.device,
            gpu_memory_utilization=gpu_memory_utilization,
            device_memory_gb=device_memory_gb,
            kv_offload=llm.kv_offload,
            trust_remote_code=llm.trust_remote_code,
        ),
    )


def planner_for(
    path: Path,
    empty: nn.Module,
    config: OffloadConfig,
    device: torch.device,
    *,
    gpu_memory_utilization: float,
    device_memory_gb: float | None,
    kv_offload: bool,
    trust_remote_code: bool = False,
) -> Callable[[int], list[OffloadConfig]] | None:
    """With a budget only (see `wants_plan`), the planner's configs for a context length,
    fastest first: what `plan_memory` tries before `config`; None otherwise."""
    if not wants_plan(config):
        return None
    return lambda context_len: planned_configs(
        path,
        empty,
        config,
        device,
        context_len=context_len,
        gpu_memory_utilization=gpu_memory_utilization,
        device_memory_gb=device_memory_gb,
        kv_offload=kv_offload,
        trust_remote_code=trust_remote_code,
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
    if not fits_at_all(shape, budgets, 1, context_len):
        return []  # nothing to measure: the fit check says why with the user's config
    measured = measure(
        path,
        shape,
        device,
        [1],
        context_len,
        settings=within(DEFAULT_SETTINGS, budgets),
        trust_remote_code=trust_remote_code,
    )
    modes = DISK_IO if config.disk.disk_io == DiskIO.AUTO else (config.disk.disk_io,)
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
    if backend == Backend.UVA and not uva.cpu_offload_params:
        uva = replace(uva, cpu_offload_gb=AUTO)
    # The host budget (the user's cpu_memory_gb) is met by the plan: the disk tier is on
    # only where the plan puts layers on disk.
    disk = replace(user.disk, cpu_memory_gb=planned.disk.cpu_memory_gb)
    return replace(
        user,
        offload_backend=Backend.AUTO if backend == Backend.NONE else backend,
        uva=uva,
        prefetch=planned.prefetch,
        disk=disk,
    )


def plan_for(
    model: str | Path | ModelSpec | None = None,
    device: str | torch.device = AUTO,
    *,
    dtype: str = AUTO,
    quantization: str | None = None,
    context_len: int | None = None,
    batch_size: int | None = None,
    max_batch: int = DEFAULT_MAX_BATCH,
    cpu_memory_gb: float | None = None,
    device_memory_gb: float | None = None,
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
    remeasure: bool = False,
    progress: Callable[[str], None] | None = None,
    trust_remote_code: bool = False,
    settings: MeasureSettings = DEFAULT_SETTINGS,
) -> Plan:
    """Plan how to run `model` (a folder, a Hugging Face id, a shipped shape such as
    "llama-3-8b", None: the default model, or its `ModelSpec` made already) on `device`: measure this machine (once,
    cached; `remeasure` measures again), then choose the placement and batch size with
    the most tokens per second under the device budget (`gpu_memory_utilization` of the
    device, or `device_memory_gb`) and the host budget (`cpu_memory_gb`, default the RAM
    available). Batch sizes: `batch_size`, or powers of two up to `max_batch`. The weights
    are planned in the form `LLM(model, dtype=dtype, quantization=quantization)` runs them
    in (a .gguf as stored on a CPU or GPU when neither is given: `stored_unless_asked`).

    To run a plan: `LLM(model, offload_config=plan.config, kv_offload=plan.kv_offload,
    max_model_len=plan.context_len)` and up to `plan.batch_size` prompts a call (an `LLM`
    given only budgets plans for batch 1 itself, see `planner_for`)."""
    spec = model if isinstance(model, ModelSpec) else None
    if spec is None:  # (the one model preamble: `model_spec`)
        spec = model_spec(
            model,
            device=device,
            dtype=dtype,
            quantization=quantization,
            quantization_name="quantization",
            trust_remote_code=trust_remote_code,
            shapes=True,
        )
    path, empty, device = spec.path, spec.empty, spec.device
    limit = model_len_limit(empty.config)
    asked_len = context_len
    context_len = min(DEFAULT_CONTEXT_LEN, limit) if context_len is None else context_len
    context_len = checked_context_len("context_len", context_len, limit)
    batch_sizes = batch_sizes_for(batch_size, max_batch)
    # Every input is checked before anything is measured: a bad flag costs nothing.
    budgets = budgets_for(device, gpu_memory_utilization, device_memory_gb, cpu_memory_gb)
    if asked_len is None:  # (a default context shrinks to fit a budget, as an LLM's does)
        context_len = fitted_context(empty, budgets, min(batch_sizes), context_len)
    shape = shape_of(empty, context_len)
    # Only the batch sizes some placement can run are measured (and their KV caches made).
    batch_sizes = measurable_batches(shape, budgets, batch_sizes, context_len)
    measured = measure(
        path,
        shape,
        device,
        batch_sizes,
        context_len,
        remeasure=remeasure,
        settings=within(settings, budgets),
        trust_remote_code=trust_remote_code,
        progress=progress,
    )
    compiles = cpu_step.may_compile(device)  # (as the planned run's steps)
    overhead = fixed_overhead(empty, path if path.is_dir() else None, compiles=compiles)
    return make_plan(shape, measured, budgets, batch_sizes, path, overhead=overhead)


def fitted_context(empty: nn.Module, budgets: Budgets, batch: int, context_len: int) -> int:
    """The default `context_len`, or where no placement fits it within `budgets` the
    longest power of two (at least `MIN_FITTED_LEN`) that one does (a log line says so);
    where none does, the default (the error then gives the numbers)."""
    length = context_len
    while not fits_at_all(shape_of(empty, length), budgets, batch, length):
        if length <= MIN_FITTED_LEN:
            return context_len
        length = shorter_power_of_two(length)
    if length != context_len:
        _logger.warning(
            "context_len %d does not fit the memory budget beside the layer stack: %d "
            "positions (set --context-len to choose)",
            context_len, length,
        )  # fmt: skip
    return length


def within(settings: MeasureSettings, budgets: Budgets) -> MeasureSettings:
    """`settings` with the probes held within the budgets where they set no limit of
    their own: the device budget (a capped process must not run out), and on a CPU given
    `cpu_memory_gb` its RAM budget."""
    if settings.max_device_bytes is None:
        settings = dataclasses.replace(settings, max_device_bytes=budgets.device_bytes)
    if settings.max_host_bytes is None and budgets.ram_bytes is not None:
        settings = dataclasses.replace(settings, max_host_bytes=budgets.ram_bytes)
    return settings
