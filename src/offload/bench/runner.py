"""Run the methods side by side: each loaded once, one untimed warm-up per batch (whose
tokens are compared with the reference's), then interleaved rounds, so that a drift in
the machine's speed touches every method alike."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from tqdm import tqdm

from offload.bench.decode import Decoded
from offload.bench.method import Figures, Method, MethodUnavailable
from offload.bench.predict import predict_latest, run_probes
from offload.bench.workload import Prepared
from offload.errors import ModelError
from offload.memory.placement import Placement
from offload.probes.around import RunProbes
from offload.probes.host import process_memory_bytes, reset_peak_rss
from offload.probes.limits import (
    Limits,
    measure_disk,
    measure_limits,
    measure_memcpy,
    measure_memory_read,
)
from offload.probes.settings import MeasureSettings

T = TypeVar("T")


@dataclass
class Loaded:
    """A method once loaded: how long it took and the memory it took (RSS growth; device
    memory allocated on a GPU)."""

    method: Method
    load_s: float
    load_rss_bytes: int
    load_device_bytes: int | None
    offloaded_bytes: int


@dataclass
class Sample:
    """One method at one batch size: its warm-up tokens and its timed runs."""

    tokens: torch.Tensor | None = None
    same_tokens: bool | None = None
    step_s: list[float] = field(default_factory=list)  # every decode step of every round
    round_step_s: list[float] = field(default_factory=list)  # each round's median step
    # The planner's step for each round's run, from compute and rates measured just before
    # it (empty: no prediction for this method).
    round_predicted_s: list[float] = field(default_factory=list)
    prefill_s: list[float] = field(default_factory=list)
    moved_bytes: dict[str, float] = field(default_factory=dict)
    stall_s: float | None = None
    num_forwards: int = 0
    peak_device_bytes: int | None = None
    peak_rss_bytes: int = 0


@dataclass
class Measured:
    limits: Limits
    loaded: list[Loaded]
    skipped: dict[str, str]
    reference: str | None
    samples: dict[tuple[str, int], Sample]
    planner: RunProbes | None = None  # None: the planner cannot time this model


def run_methods(prepared: Prepared, methods: Sequence[Method], progress: bool = True) -> Measured:
    """Measure the machine (`prepared.settings`: how much the probes move), load every
    method, warm up and time them; the methods are closed at the end whatever happens. A
    method that cannot run here, or a peer that fails to load or in its warm-up, is
    skipped with why (our own failures are raised)."""
    settings = prepared.settings
    planner, why = _planner_inputs(prepared)
    reads = planner.layer_reads if planner is not None else None
    limits = measure_limits(prepared.device, prepared.files, settings, layer_reads=reads)
    if why:
        limits.planner_note = why
    loaded: list[Loaded] = []
    skipped: dict[str, str] = {}
    workload = prepared.workload
    try:
        for method in methods:
            entry = _attempt(method, "load", skipped, lambda m=method: _load(m))
            loaded += [entry] if entry is not None else []
        total = len(loaded) * len(workload.batch_sizes) * (1 + workload.rounds)
        with tqdm(total=total, desc="offload bench", file=sys.stderr, disable=not progress) as bar:
            samples = _warm_up(prepared, loaded, skipped, bar)
            reference = _reference(loaded)
            for (_, batch), sample in samples.items():
                expected = samples[reference, batch].tokens
                sample.same_tokens = bool(torch.equal(sample.tokens, expected))
            _time_rounds(
                prepared,
                loaded,
                samples,
                bar,
                lambda: _between_rounds(prepared, limits, planner, settings),
                lambda method, batch: _around_run(
                    prepared, limits, planner, settings, method, batch
                ),
            )
    finally:
        for entry in loaded:
            entry.method.close()
        if planner is not None:
            planner.close()
    return Measured(limits, loaded, skipped, reference, samples, planner)


def _planner_inputs(prepared: Prepared) -> tuple[RunProbes | None, str]:
    """The planner's view of the model, or None and why."""
    try:
        return run_probes(prepared), ""
    except ModelError as error:
        return None, f"no prediction: {error}"


def _between_rounds(
    prepared: Prepared, limits: Limits, planner: RunProbes | None, settings: MeasureSettings
) -> None:
    """Before each round, the figures that drift: the memory copy's and the disk's rates,
    and compute per step."""
    measure_memcpy(limits, settings)
    reads = planner.layer_reads if planner is not None else None
    measure_disk(limits, prepared.files, prepared.device, settings, layer_reads=reads)
    if planner is not None:
        planner.time_compute()


def _around_run(
    prepared: Prepared,
    limits: Limits,
    planner: RunProbes | None,
    settings: MeasureSettings,
    method: Method,
    batch: int,
) -> Callable[[], float | None]:
    """Just before a timed run, measure what drifts within minutes on a virtual machine:
    the disk for a method that reads it, and for a method the planner can model its
    compute at `batch` and, where it copies layers in from host memory, the copies' rate.
    Returns what to call just after the run: the same rates measured again and the
    planner's step for the run from rates measured around it (None: no prediction)."""
    layout = method.layout(planner.shape) if planner is not None else None
    reads = planner.layer_reads if planner is not None else None
    copies = layout is not None and Placement.HOST in layout.places

    def measure_rates() -> None:
        if prepared.device.type == "cpu":  # (the read bound of the run, `Record.of_read_bound`)
            measure_memory_read(limits, settings)
        if method.reads_disk:
            measure_disk(limits, prepared.files, prepared.device, settings, layer_reads=reads)
        if copies:
            planner.measure_copies(limits, batch)

    measure_rates()
    if layout is None:
        return lambda: None
    planner.time_now(batch)

    def after() -> float:
        measure_rates()
        return predict_latest(
            planner, limits, layout, batch, reads_page_cache=method.reads_page_cache
        )

    return after


def _attempt(
    method: Method, stage: str, skipped: dict[str, str], step: Callable[[], T]
) -> T | None:
    """`step()`, or None with the reason in `skipped` (and the method closed: its memory
    and files given back) where the method cannot go on."""
    try:
        return step()
    except MethodUnavailable as why:
        skipped[method.name] = str(why)
    except Exception as error:  # a peer's own failure ends that peer, not the bench
        if method.is_ours:
            raise
        text = " ".join(str(error).split())[:300]
        skipped[method.name] = f"failed in its {stage}: {type(error).__name__}: {text}"
    method.close()
    return None


def _load(method: Method) -> Loaded:
    cuda = method.device.type == "cuda"
    reset_peak_rss()
    rss_before = process_memory_bytes()["rss_bytes"]
    device_before = torch.cuda.memory_allocated(method.device) if cuda else None
    started = time.perf_counter()
    method.load()
    load_s = time.perf_counter() - started
    device_bytes = torch.cuda.memory_allocated(method.device) - device_before if cuda else None
    rss_bytes = process_memory_bytes()["rss_bytes"] - rss_before
    return Loaded(method, load_s, rss_bytes, device_bytes, method.figures().offloaded_bytes)


def _reference(loaded: list[Loaded]) -> str | None:
    """Resident where it runs, else the first of ours, else the first method."""
    names = [entry.method.name for entry in loaded]
    ours = [entry.method.name for entry in loaded if entry.method.is_ours]
    if "resident" in names:
        return "resident"
    return (ours or names or [None])[0]


def _warm_up(
    prepared: Prepared, loaded: list[Loaded], skipped: dict[str, str], bar: tqdm
) -> dict[tuple[str, int], Sample]:
    """One untimed run per method and batch, keeping its tokens; a method that fails is
    dropped from `loaded` (closed by `_attempt`)."""
    batches, rounds = prepared.workload.batch_sizes, prepared.workload.rounds
    samples = {}
    for entry in list(loaded):
        for batch in batches:
            bar.set_postfix_str(f"warm-up {entry.method.name} batch {batch}")
            warm = _attempt(entry.method, "warm-up", skipped, lambda e=entry, b=batch: _run(e, b))
            bar.update()
            if warm is None:
                loaded.remove(entry)
                bar.total -= rounds * len(batches) + len(batches) - batches.index(batch) - 1
                break
            samples[entry.method.name, batch] = Sample(tokens=warm.tokens)
    return {key: sample for key, sample in samples.items() if key[0] not in skipped}


def _run(entry: Loaded, batch: int) -> Decoded:
    return entry.method.run(entry.method.prepared.prompt_ids(batch))


def _time_rounds(
    prepared: Prepared,
    loaded: list[Loaded],
    samples: dict[tuple[str, int], Sample],
    bar: tqdm,
    before_round: Callable[[], None],
    around_run: Callable[[Method, int], Callable[[], float | None]],
) -> None:
    """Round r runs every method once per batch (interleaved: a drift in the machine's
    speed touches every method alike), after `before_round()`; each run between
    `around_run(method, batch)`, which measures what drifts, and the call it returns,
    which gives the planner's step for that run (None: no prediction)."""
    for _ in range(prepared.workload.rounds):
        before_round()
        for batch in prepared.workload.batch_sizes:
            ids = prepared.prompt_ids(batch)
            for entry in loaded:
                bar.set_postfix_str(f"{entry.method.name} batch {batch}")
                sample = samples[entry.method.name, batch]
                after = around_run(entry.method, batch)
                _timed_run(entry.method, ids, sample)
                predicted = after()
                if predicted is not None:
                    sample.round_predicted_s.append(predicted)
                bar.update()


def _timed_run(method: Method, ids: torch.Tensor, sample: Sample) -> None:
    cuda = method.device.type == "cuda"
    reset_peak_rss()
    if cuda:
        torch.cuda.reset_peak_memory_stats(method.device)
        allocated_before = torch.cuda.memory_allocated(method.device)
    before = method.figures()
    decoded = method.run(ids)
    _add(sample, decoded, before, method.figures())
    sample.peak_rss_bytes = max(sample.peak_rss_bytes, process_memory_bytes()["peak_rss_bytes"])
    if cuda:  # what this run took above what was allocated when it began
        growth = torch.cuda.max_memory_allocated(method.device) - allocated_before
        sample.peak_device_bytes = max(sample.peak_device_bytes or 0, growth)


def _add(sample: Sample, decoded: Decoded, before: Figures, after: Figures) -> None:
    sample.step_s += decoded.step_s
    sample.round_step_s.append(statistics.median(decoded.step_s))
    sample.prefill_s.append(decoded.prefill_s)
    sample.num_forwards += decoded.num_forwards
    for link, num_bytes in after.moved_bytes.items():
        moved = num_bytes - before.moved_bytes.get(link, 0)
        sample.moved_bytes[link] = sample.moved_bytes.get(link, 0) + moved
    if after.stall_s is not None:
        sample.stall_s = (sample.stall_s or 0.0) + after.stall_s - (before.stall_s or 0.0)
