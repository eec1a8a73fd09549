"""From measurements to the result (`records.py`): one record per method and batch size,
with its bound, plus the workload, the machine's limits and where compute per step came
from."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

from offload.bench.bound import bound_step, step_over_bound
from offload.bench.catalog import METHODS
from offload.bench.method import Method
from offload.bench.planned import Planned
from offload.bench.records import BenchResult, Compute, PlanAgainstHand, Record, RunWorkload
from offload.bench.runner import Loaded, Measured, Sample, run_methods
from offload.bench.workload import Prepared, Workload, prepare
from offload.errors import ConfigError
from offload.planner.choose import evaluate
from offload.probes.limits import Limits
from offload.probes.settings import DEFAULT_SETTINGS, MeasureSettings

RESIDENT_COMPUTE = "resident step"
ESTIMATED_COMPUTE = "the planner's compute probe (the model cut to 2 layers, random weights)"


def run_bench(
    workload: Workload,
    methods: Sequence[str | type[Method]] | None = None,
    progress: bool = True,
    settings: MeasureSettings = DEFAULT_SETTINGS,
) -> BenchResult:
    """Run `methods` (names from `METHODS` or Method classes; default: all) on `workload`
    and return the result (see `result`); `settings`: how much the probes of the machine
    move and how often they repeat."""
    chosen = [_method(m) for m in (methods or list(METHODS))]
    prepared = dataclasses.replace(prepare(workload), settings=settings)
    measured = run_methods(prepared, [method(prepared) for method in chosen], progress)
    return result(prepared, measured)


def of_read_bound(weight_bytes: int, limits: Limits, step_s: float) -> float | None:
    """The read bound (`weight_bytes` over the memory read rate: a CPU step reads each
    weight once) over `step_s`; None where the rate was not measured (a GPU)."""
    rate = limits.memory_read_gb_per_s
    if not rate or not step_s:
        return None
    return weight_bytes / (rate * 1e9) / step_s


def _method(method: str | type[Method]) -> type[Method]:
    if not isinstance(method, str):
        return method
    if method not in METHODS:
        raise ConfigError(f"methods (--methods) must be among {', '.join(METHODS)}; got {method!r}")
    return METHODS[method]


def result(prepared: Prepared, measured: Measured) -> BenchResult:
    compute_s, source = compute_per_step(prepared, measured)
    links = measured.limits.link_gb_per_s()
    records = []
    for entry in measured.loaded:
        for batch in prepared.workload.batch_sizes:
            sample = measured.samples[entry.method.name, batch]
            figures = record(entry, batch, sample, compute_s, links)
            of_read = of_read_bound(prepared.total_bytes, measured.limits, figures["step_s"])
            records.append(
                Record(
                    **figures, **prediction(entry.method, batch, measured), of_read_bound=of_read
                )
            )
    planner = measured.planner
    return BenchResult(
        workload=workload_fields(prepared),
        limits=measured.limits,
        compute=Compute(source, compute_s),
        planner=planner.measurements(measured.limits) if planner else None,
        reference=measured.reference,
        skipped=measured.skipped,
        records=records,
        plan_against_hand=plan_against_hand(measured, records),
    )


def compute_per_step(prepared: Prepared, measured: Measured) -> tuple[dict[int, float], str]:
    """Compute per decode step at each batch: resident's step where it ran, else an
    estimate from a 2-layer model (none where the layer count cannot be changed)."""
    if any(entry.method.name == "resident" for entry in measured.loaded):
        steps = {
            batch: statistics.median(measured.samples["resident", batch].step_s)
            for batch in prepared.workload.batch_sizes
        }
        return steps, RESIDENT_COMPUTE
    if measured.planner is None:
        return {}, "unknown"
    return measured.planner.step_s(), ESTIMATED_COMPUTE


def prediction(method: Method, batch: int, measured: Measured) -> dict[str, Any]:
    """The planner's predicted step for the method at `batch` and its ratio to the
    measured step: medians over the rounds, each round's run against the prediction made
    just before it (None where the planner has no such layout)."""
    sample = measured.samples[method.name, batch]
    predicted = sample.round_predicted_s
    if not predicted:
        return {"predicted_step_s": None, "predicted_over_step": None, "round_predicted_s": []}
    paired = zip(predicted, sample.round_step_s, strict=True)
    return {
        "predicted_step_s": statistics.median(predicted),
        "predicted_over_step": statistics.median(p / s for p, s in paired),
        "round_predicted_s": predicted,
    }


def record(
    entry: Loaded,
    batch: int,
    sample: Sample,
    compute_s: dict[int, float],
    links: dict[str, float | None],
) -> dict[str, Any]:
    """The figures of one method at one batch size."""
    method = entry.method
    step_s = statistics.median(sample.step_s)
    moved = {
        link: num_bytes / sample.num_forwards for link, num_bytes in sample.moved_bytes.items()
    }
    return {
        "method": method.name,
        "label": method.label,
        "is_ours": method.is_ours,
        "setting": method.setting(),
        "batch": batch,
        **_timing(batch, sample, step_s),
        "offloaded_bytes": entry.offloaded_bytes,
        "moved_bytes_per_forward": sum(moved.values()),
        "moved_bytes_per_forward_by_link": moved,
        "achieved_gb_per_s": sum(moved.values()) / step_s / 1e9,
        "stall_s_per_step": (
            sample.stall_s / sample.num_forwards if sample.stall_s is not None else None
        ),
        **_memory(entry, sample),
        "same_tokens": sample.same_tokens,
        **_bound(batch, step_s, compute_s.get(batch), moved, links),
    }


def _timing(batch: int, sample: Sample, step_s: float) -> dict[str, float]:
    return {
        "tokens_per_s": batch / step_s,  # decode: batch / median step
        "tokens_per_s_min": batch / max(sample.round_step_s),
        "tokens_per_s_max": batch / min(sample.round_step_s),
        "step_s": step_s,
        "step_s_min": min(sample.step_s),
        "step_s_max": max(sample.step_s),
        "prefill_s": statistics.median(sample.prefill_s),
        "round_step_s": sample.round_step_s,
    }


def _memory(entry: Loaded, sample: Sample) -> dict[str, Any]:
    peak_device = None
    if entry.load_device_bytes is not None:  # its own weights, plus what a run took above
        peak_device = entry.load_device_bytes + (sample.peak_device_bytes or 0)
    return {
        "peak_device_bytes": peak_device,
        "peak_rss_bytes": sample.peak_rss_bytes,
        "load_s": entry.load_s,
        "load_rss_bytes": entry.load_rss_bytes,
        "load_device_bytes": entry.load_device_bytes,
    }


def _bound(
    batch: int,
    step_s: float,
    compute_s: float | None,
    moved: dict[str, float],
    links: dict[str, float | None],
) -> dict[str, Any]:
    bound = bound_step(compute_s, moved, links)
    return {
        "compute_s": compute_s,
        "bound_step_s": bound.step_s,
        "bound_limit": bound.limit,
        "bound_link_s": bound.link_s,
        "bound_tokens_per_s": batch / bound.step_s if bound.step_s else None,
        "step_over_bound": step_over_bound(step_s, bound.step_s),
    }


def plan_against_hand(measured: Measured, records: list[Record]) -> list[PlanAgainstHand]:
    """Per batch, the plan's tokens/s beside the best of our hand settings that fit the
    plan's budgets (as the planner counts memory), and the plan's speed over the best's:
    the median over rounds of the two runs of the same round (a drift of the machine
    touches both alike); empty without a plan."""
    planned = [e.method for e in measured.loaded if isinstance(e.method, Planned)]
    if not planned or measured.planner is None:
        return []
    plan, planner = planned[0].plan, measured.planner
    rates = planner.measurements(measured.limits)
    fitting = set()
    for entry in measured.loaded:
        method = entry.method
        layout = method.layout(planner.shape) if method is not planned[0] else None
        batch = max(plan.measured.measurements.batch_sizes)
        if layout is not None and evaluate(
            planner.shape, rates, plan.budgets, layout, batch, False
        ):
            fitting.add(method.name)
    rows = []
    for batch in measured.planner.batch_sizes:
        at = {r.method: r.tokens_per_s for r in records if r.batch == batch}
        best = max(sorted(fitting), key=at.__getitem__, default=None)
        ratios = []
        if best:
            rounds = (
                measured.samples[name, batch].round_step_s for name in (best, planned[0].name)
            )
            ratios = [hand / ours for hand, ours in zip(*rounds, strict=True)]
        rows.append(
            PlanAgainstHand(
                batch=batch,
                fitting=sorted(fitting),
                plan_tokens_per_s=at[planned[0].name],
                best_hand=best,
                best_hand_tokens_per_s=at[best] if best else None,
                plan_over_best_hand=statistics.median(ratios) if best else None,
                plan_over_best_hand_rounds=ratios,
            )
        )
    return rows


def workload_fields(prepared: Prepared) -> RunWorkload:
    workload = prepared.workload
    return RunWorkload(
        model=prepared.name,
        quantization=workload.quantization,
        path=str(prepared.path),
        dtype=str(prepared.dtype).removeprefix("torch."),
        device=str(prepared.device),
        batch_sizes=list(workload.batch_sizes),
        prompt_len=workload.prompt_len,
        output_len=workload.output_len,
        rounds=workload.rounds,
        total_bytes=prepared.total_bytes,
        num_layers=len(prepared.layer_bytes),
        layer_bytes=prepared.layer_bytes,
        checkpoint_bytes=sum(path.stat().st_size for path in prepared.files),
    )
