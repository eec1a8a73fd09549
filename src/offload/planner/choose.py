"""The planner's candidates: every layout (see `layouts.py`) at every measured batch size,
with the KV cache on the device or, where it does not fit there, in host memory; those
that fit the device and host budgets are predicted with the cost model, and the one with
the most tokens per second wins (ties: fewer bytes offloaded, then the smaller batch).
On a CPU given `cpu_memory_gb` the device and the host are one RAM with one budget
(`budget.py`): a candidate fits when its layers in RAM, slots, KV cache and activations do."""

from __future__ import annotations

import math
from dataclasses import dataclass

from offload.config import DISK_IO
from offload.errors import ModelError
from offload.memory.kv_shape import KV_SLOTS
from offload.memory.placement import DiskIO, Placement
from offload.planner import layouts
from offload.planner.budget import RamUse, least_ram, ram_budget_error, ram_use
from offload.planner.cost import LayerCost, StepTime, predict_step, touched_share
from offload.planner.fit import MARGIN_BYTES, MemoryNeeds
from offload.planner.layouts import Layout
from offload.planner.measurements import Measurements
from offload.planner.shape import ModelShape
from offload.sizes import GIB, format_bytes


@dataclass(frozen=True)
class Budgets:
    """Bytes the plan may use: on the device (weights, slots, KV cache, activations), in
    host memory (offloaded weights, a KV cache kept there), and, on a CPU, the page cache
    room that keeps mapped checkpoint files warm (0: never map them). `ram_bytes`: on a
    CPU given `cpu_memory_gb`, the one budget that all of them share instead (the weights
    outside the stack aside: they are in the fixed overhead); None: the budgets apart."""

    device_bytes: int
    host_bytes: int
    page_cache_bytes: int = 0
    ram_bytes: int | None = None

    @classmethod
    def of_ram(cls, ram_bytes: int) -> Budgets:
        """A CPU's one budget of `ram_bytes` (nothing mapped beyond it)."""
        return cls(ram_bytes, ram_bytes, 0, ram_bytes)


@dataclass(frozen=True)
class Candidate:
    """A layout at a batch size, with its prediction and the memory it takes."""

    layout: Layout
    batch_size: int
    kv_offload: bool
    time: StepTime
    device_bytes: int
    host_bytes: int
    ram: RamUse | None = None  # on a CPU's one budget, what it holds there

    @property
    def tokens_per_s(self) -> float:
        return self.batch_size / self.time.step_s if self.time.step_s > 0 else float("inf")

    @property
    def label(self) -> str:
        return self.layout.label + (", KV cache in host memory" if self.kv_offload else "")


def candidates(
    shape: ModelShape,
    measured: Measurements,
    budgets: Budgets,
    batch_sizes: list[int],
    disk_modes: tuple[DiskIO, ...] = DISK_IO,
    kv_given: bool | None = None,
) -> list[Candidate]:
    """Every candidate that fits the budgets, best first; with the KV cache where the
    planner puts it, or where `kv_given` says (True: in host memory, even if it fits on
    the device)."""
    if budgets.ram_bytes is not None:
        return _within_ram(shape, measured, budgets, batch_sizes, disk_modes, kv_given)
    found = []
    fixed = [layouts.resident(shape), *_prefetch_layouts(shape, measured, budgets, disk_modes)]
    kv_modes = (False, True) if kv_given is None else (kv_given,)
    for batch in batch_sizes:
        for kv_offload in kv_modes:
            options = [*fixed, *_uva_layouts(shape, budgets, batch, kv_offload, measured)]
            for layout in options:
                candidate = evaluate(
                    shape, measured, budgets, layout, batch, kv_offload, kv_given is not None
                )
                if candidate is not None:
                    found.append(candidate)
    found.sort(key=_ranking)
    return found


def _within_ram(
    shape: ModelShape,
    measured: Measurements,
    budgets: Budgets,
    batch_sizes: list[int],
    disk_modes: tuple[DiskIO, ...],
    kv_given: bool | None,
) -> list[Candidate]:
    """`candidates` on a CPU's one budget: every layer resident, and the prefetch layouts
    that keep in RAM what the budget leaves at each batch. No UVA (RAM is the device's
    memory: it frees nothing) and no mapping beyond the budget (mapped pages count in RSS,
    as kept layers do, and read from disk when evicted)."""
    io = DiskIO.DIRECT if DiskIO.DIRECT in disk_modes else disk_modes[0]
    budget_gb = layouts.hundredths(budgets.ram_bytes / GIB, math.floor)
    found = []
    for batch in batch_sizes:
        for kv_offload in (False,) if kv_given is None else (kv_given,):
            kv = _kv_in_ram(shape, batch, measured.context_len, kv_offload)
            room = budgets.ram_bytes - kv - shape.activation_bytes - MARGIN_BYTES
            options = layouts.prefetch_layouts_within(shape, room, io, budget_gb)
            for layout in [layouts.resident(shape), *options]:
                if layout.disk_bytes and measured.disk_gb_per_s <= 0:
                    continue  # the disk was not measured: no disk tier
                found.append(evaluate(shape, measured, budgets, layout, batch, kv_offload))
    found = [candidate for candidate in found if candidate is not None]
    found.sort(key=_ranking)
    return found


def _kv_in_ram(shape: ModelShape, batch: int, context_len: int, kv_offload: bool) -> int:
    """The KV cache's bytes in a CPU's RAM: all of it, and its ring of slots when the
    user keeps it "in host memory" (the same RAM)."""
    total = shape.kv_bytes(batch, context_len)
    return total + (_kv_on_device(shape, batch, context_len, True) if kv_offload else 0)


def fits_at_all(shape: ModelShape, budgets: Budgets, batch: int, context_len: int) -> bool:
    """Whether some placement could hold `batch` sequences of `context_len` positions:
    its KV cache and activations with the least weights any layout keeps on the device
    (UVA of every layer: those outside them), in or out of host memory; what measuring
    that batch allocates is no more."""
    kv = shape.kv_bytes(batch, context_len)
    if budgets.ram_bytes is not None:
        return least_ram(shape, batch, context_len).total_bytes <= budgets.ram_bytes
    least_weights = shape.outside_bytes
    on_device = device_need(shape, least_weights, kv) <= budgets.device_bytes
    ring = _kv_on_device(shape, batch, context_len, True)
    in_host = device_need(shape, least_weights, ring) <= budgets.device_bytes
    return on_device or (in_host and kv <= budgets.host_bytes)


def _ranking(candidate: Candidate) -> tuple[float, int, int]:
    """Most tokens/s first (equal to 6 digits: the sums of the simulation differ in the
    last bits), then the fewest bytes offloaded, then the smaller batch."""
    tokens = float(f"{candidate.tokens_per_s:.6g}")
    return -tokens, candidate.layout.offloaded_bytes, candidate.batch_size


def nothing_fits(shape: ModelShape, budgets: Budgets, batch: int, context_len: int) -> ModelError:
    """Why no candidate fits, with the numbers."""
    if budgets.ram_bytes is not None:
        return ram_budget_error(shape, budgets.ram_bytes, batch, context_len)
    floor = device_need(shape, shape.outside_bytes + max(shape.layer_bytes), 0)
    return ModelError(
        f"no placement fits: the device budget is {format_bytes(budgets.device_bytes)}, "
        f"the host budget {format_bytes(budgets.host_bytes)}; with every layer offloaded "
        f"the device still needs {format_bytes(floor)} at least (weights outside the "
        f"layers, a slot, activations) and the KV cache "
        f"{format_bytes(shape.kv_bytes(batch, context_len))} at batch {batch}; lower the "
        f"context length or raise the budgets"
    )


def _prefetch_layouts(
    shape: ModelShape, measured: Measurements, budgets: Budgets, disk_modes: tuple[DiskIO, ...]
) -> list[Layout]:
    """Prefetch layouts: with the disk tier where the disk was measured, and on a CPU with
    its disk layers mapped where the page cache keeps them warm."""
    io = DiskIO.DIRECT if DiskIO.DIRECT in disk_modes else disk_modes[0]
    found = [
        layout
        for layout in layouts.prefetch_layouts(shape, budgets.host_bytes, io)
        if not layout.disk_bytes or measured.disk_gb_per_s > 0
    ]
    if measured.device_type == "cpu" and DiskIO.MMAP in disk_modes:
        found += [
            layout
            for layout in layouts.prefetch_layouts(shape, budgets.host_bytes, DiskIO.MMAP)
            if 0 < layout.disk_bytes <= budgets.page_cache_bytes
        ]
    return found


def _uva_layouts(
    shape: ModelShape, budgets: Budgets, batch: int, kv_offload: bool, measured: Measurements
) -> list[Layout]:
    """The least UVA that fits at this batch: of the layers' weights, and of the experts."""
    kv = _kv_on_device(shape, batch, measured.context_len, kv_offload)
    needed = device_need(shape, shape.weight_bytes, kv) - budgets.device_bytes
    options = [layouts.uva(shape, needed)]
    if shape.num_experts:
        options.append(layouts.uva(shape, needed, experts_only=True))
    return [layout for layout in options if layout is not None]


def evaluate(
    shape: ModelShape,
    measured: Measurements,
    budgets: Budgets,
    layout: Layout,
    batch: int,
    kv_offload: bool,
    kv_given: bool = False,
) -> Candidate | None:
    """`layout` at `batch` predicted, or None where it does not fit the budgets (or keeps
    the KV cache in host memory though it fits on the device, unless `kv_given`: the
    user put it there)."""
    kv_total = shape.kv_bytes(batch, measured.context_len)
    if kv_offload and not kv_total:
        return None  # no KV cache to move
    if budgets.ram_bytes is not None:
        return _evaluate_in_ram(shape, measured, budgets, layout, batch, kv_offload)
    resident_bytes = shape.weight_bytes - layout.offloaded_bytes + layout.staging_bytes
    kv = _kv_on_device(shape, batch, measured.context_len, kv_offload)
    device_bytes = device_need(shape, resident_bytes, kv)
    host_bytes = layout.host_bytes + (kv_total if kv_offload else 0)
    if device_bytes > budgets.device_bytes or host_bytes > budgets.host_bytes:
        return None
    fits = device_need(shape, resident_bytes, kv_total) <= budgets.device_bytes
    if kv_offload and fits and not kv_given:
        return None  # the KV cache fits on the device: moving it only costs time
    time = predict_layout(shape, measured, layout, batch, kv_total if kv_offload else 0)
    return Candidate(layout, batch, kv_offload, time, device_bytes, host_bytes)


def _evaluate_in_ram(
    shape: ModelShape,
    measured: Measurements,
    budgets: Budgets,
    layout: Layout,
    batch: int,
    kv_offload: bool,
) -> Candidate | None:
    """`evaluate` on a CPU's one budget (the KV cache where the caller put it)."""
    kv = _kv_in_ram(shape, batch, measured.context_len, kv_offload)
    use = ram_use(shape, layout, kv)
    if use.total_bytes > budgets.ram_bytes:
        return None
    kv_total = shape.kv_bytes(batch, measured.context_len)
    time = predict_layout(shape, measured, layout, batch, kv_total if kv_offload else 0)
    return Candidate(layout, batch, kv_offload, time, use.total_bytes, 0, use)


def predict_layout(
    shape: ModelShape, measured: Measurements, layout: Layout, batch: int, kv_moved_bytes: int
) -> StepTime:
    """A step of `layout` at `batch` positions, with `kv_moved_bytes` of KV cache brought in."""
    layer_s, head_s = measured.compute_at(batch)
    costs = _layer_costs(shape, layout, layer_s, batch, kv_moved_bytes)
    return predict_step(costs, head_s, measured.rates(), layout.prefetch_step, KV_SLOTS)


def _layer_costs(
    shape: ModelShape, layout: Layout, layer_s: float, batch: int, kv_bytes: int
) -> list[LayerCost]:
    share = touched_share(shape.num_experts, shape.experts_per_token, batch)
    per_layer_kv = kv_bytes // max(1, shape.num_layers)
    costs = []
    for place, num_bytes in zip(layout.places, layout.off_bytes, strict=True):
        if place == Placement.UVA and layout.experts_only:
            num_bytes = int(num_bytes * share)  # the experts this batch routes to
        elif place in (Placement.MAPPED, Placement.RESIDENT):
            num_bytes = 0
        costs.append(LayerCost(layer_s, place, num_bytes, per_layer_kv))
    return costs


def _kv_on_device(shape: ModelShape, batch: int, context_len: int, kv_offload: bool) -> int:
    """The KV cache's device bytes: all of it, or the ring of slots when it is offloaded."""
    total = shape.kv_bytes(batch, context_len)
    if not kv_offload:
        return total
    return min(KV_SLOTS, shape.num_layers) * total // max(1, shape.num_layers)


def device_need(shape: ModelShape, weight_bytes: int, kv_bytes: int) -> int:
    """Device bytes for these weights and KV cache, with activations and the margin as
    the engine counts them (`planner/fit.py`)."""
    needs = MemoryNeeds(weight_bytes, 0, 0, kv_bytes, shape.activation_bytes)
    return needs.total
