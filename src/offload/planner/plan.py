"""A plan: the chosen candidate, the best alternatives of other kinds, and the reasons,
from a model's shape, the measurements and the budgets (`offload.llm.auto.plan_for`
measures, then makes one for a model named as `LLM` takes it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from offload.config import DISK_IO, OffloadConfig
from offload.config.validate import gib, integer
from offload.memory.host import available_ram_bytes
from offload.memory.placement import DiskIO
from offload.planner.budget import least_ram, overhead_without_tokenizer, ram_use
from offload.planner.choose import Budgets, Candidate, candidates, fits_at_all, nothing_fits
from offload.planner.fit import device_budget
from offload.planner.layouts import resident
from offload.planner.measurements import Measured
from offload.planner.overhead import FixedOverhead
from offload.planner.shape import ModelShape
from offload.sizes import GIB, format_bytes

NUM_ALTERNATIVES = 3


@dataclass(frozen=True)
class Plan:
    """The setting chosen for a model on this machine: `chosen` (its layout's config, batch
    size, KV cache place and prediction), `alternatives` (the best of other kinds), the
    inputs and the reasons, one line each."""

    chosen: Candidate
    alternatives: tuple[Candidate, ...]
    candidates: tuple[Candidate, ...]  # every one that fits, best first
    shape: ModelShape
    measured: Measured
    budgets: Budgets
    path: Path
    reasons: tuple[str, ...]
    overhead: FixedOverhead  # beside the budgets: peak RSS is theirs + this on a CPU

    @property
    def config(self) -> OffloadConfig:
        return self.chosen.layout.config

    @property
    def batch_size(self) -> int:
        return self.chosen.batch_size

    @property
    def kv_offload(self) -> bool:
        return self.chosen.kv_offload

    @property
    def context_len(self) -> int:
        return self.measured.measurements.context_len


def make_plan(
    shape: ModelShape,
    measured: Measured,
    budgets: Budgets,
    batch_sizes: list[int],
    path: Path,
    disk_modes: tuple[DiskIO, ...] = DISK_IO,
    overhead: FixedOverhead | None = None,
) -> Plan:
    """The plan from a model's shape and the measurements, under the budgets; a
    `ModelError` with the numbers where nothing fits. `overhead`: the model's fixed
    overhead (`planner.overhead.fixed_overhead`; None: the shape's, no tokenizer)."""
    overhead = overhead or overhead_without_tokenizer(shape)
    found = candidates(shape, measured.measurements, budgets, batch_sizes, disk_modes)
    if not found:
        raise nothing_fits(shape, budgets, min(batch_sizes), measured.measurements.context_len)
    chosen = found[0]
    return Plan(
        chosen,
        alternatives(found),
        tuple(found),
        shape,
        measured,
        budgets,
        path,
        tuple(_reasons(shape, measured, budgets, found, batch_sizes, overhead)),
        overhead,
    )


def kind_of(candidate: Candidate) -> tuple:
    """What sets candidates apart for a reader: backend, disk tier, KV cache, batch."""
    config = candidate.layout.config
    disk = config.disk.disk_io if config.disk.is_active else None
    return (config.selected_backend, disk, candidate.kv_offload, candidate.batch_size)


def alternatives(found: list[Candidate]) -> tuple[Candidate, ...]:
    """The best candidate of each kind other than the chosen one's, best first."""
    seen, picked = {kind_of(found[0])}, []
    for candidate in found[1:]:
        if kind_of(candidate) not in seen and len(picked) < NUM_ALTERNATIVES:
            seen.add(kind_of(candidate))
            picked.append(candidate)
    return tuple(picked)


def _reasons(
    shape: ModelShape,
    measured: Measured,
    budgets: Budgets,
    found: list[Candidate],
    batch_sizes: list[int],
    overhead: FixedOverhead,
) -> list[str]:
    m, chosen = measured.measurements, found[0]
    common = max(set(shape.layer_bytes), key=shape.layer_bytes.count)
    layer_s, head_s = m.compute_at(chosen.batch_size)
    lines = [
        f"weights {format_bytes(shape.weight_bytes)}: {shape.num_layers} layers of "
        f"{format_bytes(common)}, {format_bytes(shape.outside_bytes)} outside them (resident); "
        f"KV cache {format_bytes(shape.kv_bytes(1, m.context_len))} per sequence at "
        f"{m.context_len} positions",
        _budget_line(budgets, overhead),
        f"measured on {m.machine}: link {m.link_gb_per_s:.1f} GB/s"
        + (f", UVA reads {m.uva_gb_per_s:.1f} GB/s" if m.uva_gb_per_s else "")
        + f", disk "
        f"{m.disk_gb_per_s:.2f} GB/s ({m.disk_source or 'not measured'}); compute at batch "
        f"{chosen.batch_size}: {layer_s * 1e3:.2f} ms a layer, {head_s * 1e3:.2f} ms the rest",
        *m.notes,
    ]
    if budgets.ram_bytes is not None:
        return lines + _bound_in_ram(shape, budgets, found, m.context_len)
    larger = [c for c in found if c.batch_size > chosen.batch_size]
    if chosen.batch_size < max(batch_sizes):
        lines.append(
            f"batch {chosen.batch_size}: larger batches are predicted no faster"
            if larger
            else f"batch {chosen.batch_size}: no larger batch fits the budgets (KV cache)"
        )
    return lines


def _budget_line(budgets: Budgets, overhead: FixedOverhead) -> str:
    if budgets.ram_bytes is None:
        return (
            f"budgets: device {format_bytes(budgets.device_bytes)}, host "
            f"{format_bytes(budgets.host_bytes)} for weights kept off the device"
        )
    return (
        f"budget: {format_bytes(budgets.ram_bytes)} of RAM (cpu_memory_gb) for the layers' "
        f"weights held in RAM, the slots, the KV cache and activations; beside it the fixed "
        f"overhead, {overhead.describe()}: peak RSS within "
        f"{format_bytes(budgets.ram_bytes + overhead.total_bytes)}"
    )


def _bound_in_ram(
    shape: ModelShape, budgets: Budgets, found: list[Candidate], context_len: int
) -> list[str]:
    """Which limits of the RAM budget bound the choice: the layers offloaded (every one
    resident does not fit) and the batch (a larger one does not fit, or is no faster)."""
    chosen, lines = found[0], []
    batch = chosen.batch_size
    if chosen.layout.offloaded_bytes:
        whole = ram_use(shape, resident(shape), shape.kv_bytes(batch, context_len))
        lines.append(
            f"bound by the RAM budget: every layer resident needs {format_bytes(whole.total_bytes)} "
            f"at batch {batch} ({whole.describe()})"
        )
    if any(c.batch_size > batch for c in found):
        return [*lines, f"batch {batch}: larger batches are predicted no faster"]
    least = least_ram(shape, 2 * batch, context_len)
    if least.total_bytes > budgets.ram_bytes:
        lines.append(
            f"batch {batch}: batch {2 * batch} does not fit the RAM budget (it needs "
            f"{format_bytes(least.total_bytes)} with every layer read from disk: "
            f"{least.describe()})"
        )
    return lines


def measurable_batches(
    shape: ModelShape, budgets: Budgets, batch_sizes: list[int], context_len: int
) -> list[int]:
    """The batch sizes some placement could run within the budgets: the only ones worth
    measuring (their KV caches are what measuring them allocates). A `ModelError` with
    the numbers where none is."""
    fitting = [b for b in batch_sizes if fits_at_all(shape, budgets, b, context_len)]
    if not fitting:
        raise nothing_fits(shape, budgets, min(batch_sizes), context_len)
    return fitting


def batch_sizes_for(batch_size: int | None, max_batch: int) -> list[int]:
    """`[batch_size]`, or the powers of two up to `max_batch`."""
    if batch_size is not None:
        batch_size = integer("batch_size", batch_size, 1)
    max_batch = integer("max_batch", max_batch, 1)
    if batch_size is not None:
        return [batch_size]
    return [2**k for k in range(max_batch.bit_length()) if 2**k <= max_batch]


def budgets_for(
    device: torch.device,
    gpu_memory_utilization: float,
    device_memory_gb: float | None,
    cpu_memory_gb: float | None,
) -> Budgets:
    """The device budget as the engine counts it; the host budget: `cpu_memory_gb`, else
    the RAM available (on a CPU, less the device budget: it is the same memory). On a CPU,
    the RAM left beside both keeps mapped checkpoint pages warm. On a CPU given
    `cpu_memory_gb` (and no emulated device), that is the one budget of the RAM
    (`Budgets.of_ram`, see `budget.py`)."""
    if cpu_memory_gb is not None:
        cpu_memory_gb = gib("cpu_memory_gb", cpu_memory_gb)
    device_bytes = device_budget(device, gpu_memory_utilization, device_memory_gb)
    on_cpu = device.type == "cpu"
    if on_cpu and cpu_memory_gb is not None and device_memory_gb is None:
        return Budgets.of_ram(int(cpu_memory_gb * GIB))
    available = available_ram_bytes()
    if cpu_memory_gb is not None:
        host_bytes = int(cpu_memory_gb * GIB)
    else:
        host_bytes = max(0, available - device_bytes) if on_cpu else available
    page_cache = max(0, available - device_bytes - host_bytes) if on_cpu else 0
    return Budgets(device_bytes, host_bytes, page_cache)
