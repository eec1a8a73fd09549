"""The planner's prediction of each of our methods' decode step, from measurements taken
in the same run as the methods (`offload.probes.around`): compute timed with
transformers' `generate`, the loop every method runs, and the rates measured around each
run. A method's figure is the median over rounds of predicted / measured
(`results.prediction`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from offload.bench.decode import greedy_decode
from offload.bench.workload import Prepared
from offload.planner.choose import Budgets, evaluate
from offload.planner.layouts import Layout
from offload.probes.around import RunProbes
from offload.probes.compute import StepTimer
from offload.probes.limits import Limits

UNLIMITED = Budgets(2**62, 2**62, 2**62)  # every layout fits: bench chose them by hand


def run_probes(prepared: Prepared) -> RunProbes:
    """The probes of a bench run of `prepared`'s workload."""
    work = prepared.workload
    return RunProbes.of(
        prepared.path,
        prepared.dtype,
        prepared.device,
        work.prompt_len + work.output_len,
        list(work.batch_sizes),
        _generate_steps(prepared),
        prepared.settings,
    )


def predict_latest(
    probes: RunProbes, limits: Limits, layout: Layout, batch: int, *, reads_page_cache: bool
) -> float:
    """The planner's step for `layout` at `batch` from the measurements around the last
    run at `batch` (`RunProbes.latest`)."""
    latest = probes.latest(limits, batch, reads_page_cache=reads_page_cache)
    found = evaluate(probes.shape, latest, UNLIMITED, layout, batch, kv_offload=False)
    assert found is not None, "an unlimited budget fits every layout"
    return found.time.step_s


def _generate_steps(prepared: Prepared) -> StepTimer:
    """Compute timed as the methods run: a decode step of transformers' `generate` (its
    dynamic cache, its logits processing) on the workload's prompts, the median of one
    call's steps. At large batches that loop costs more per step than the engine's
    static-cache step the planner times by default (docs/benchmarks.md)."""
    output_len = prepared.workload.output_len

    def timer(model: torch.nn.Module, batch: int) -> Callable[[], float]:
        ids = prepared.prompt_ids(batch)
        return lambda: statistics.median(
            greedy_decode(model, ids, output_len, prepared.device).step_s
        )

    return timer
