"""The planner's prediction of each of our methods' decode step, from measurements taken in
the same run as the methods: a virtual machine's disk, memory and compute speeds drift
within minutes, so a prediction is fair only against rates of the same moment. Before
each timed run of a method the runner measures the rates it depends on (on a CPU, the
prefetch backend's copies in a forward, `measure_copies`, for a method that copies layers
in; the disk, for one that reads it) and `time_now` times compute at that batch with the
planner's own probe (two models of the same config cut to a few layers, random weights,
decoding with transformers' `generate` as the methods do); after the run the rates are
measured again,
and `predict_latest` predicts from rates measured around the run. Each run gets a
prediction of its own moment, and a method's figure is the median over rounds of
predicted / measured (`results.prediction`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from offload.bench.decode import greedy_decode
from offload.bench.limits import TIER_WAY, Limits
from offload.bench.workload import Prepared
from offload.model.build import build_empty
from offload.planner.choose import Budgets, evaluate
from offload.planner.layouts import Layout
from offload.planner.measurements import Measurements
from offload.planner.shape import ModelShape, shape_of
from offload.probes import bandwidth as probes
from offload.probes.compute import DecodeTimer, ForwardCopies, StepTimer
from offload.probes.measure import checkpoint_reads, machine_name, software

UNLIMITED = Budgets(2**62, 2**62, 2**62)  # every layout fits: bench chose them by hand
_UVA_PROBE_BYTES = 256 * 2**20
# Compute timed before each run: two pairs of `generate` calls (the warm-ups were each
# round's), medians over the rounds.
_PAIRED_REPEATS = 2
_RATE_WINDOW = 3  # a rate around a run: the median of its last measurements
_COPY_REPEATS = 3  # decode steps of the streamed cut model per measurement of its copies


@dataclass
class PlannerInputs:
    """The model's shape for the planner and its compute, every time it was timed (before
    each round at every batch, and before each run of ours at its batch)."""

    prepared: Prepared
    shape: ModelShape
    timer: DecodeTimer
    layer_reads: list | None  # the disk tier's reads, layer by layer (None: files in order)
    uva_gb_per_s: float = 0.0
    copies: ForwardCopies | None = None  # built when first needed (a CPU only)
    layer_s: dict[int, list[float]] = field(default_factory=dict)
    head_s: dict[int, list[float]] = field(default_factory=dict)

    @classmethod
    def of(cls, prepared: Prepared) -> PlannerInputs:
        work = prepared.workload
        context_len = work.prompt_len + work.output_len
        shape = shape_of(build_empty(prepared.path, prepared.dtype), context_len)
        timer = DecodeTimer(
            prepared.path, shape, prepared.device, context_len, step_timer=_generate_steps(prepared)
        )
        uva = probes.uva_gb_per_s(prepared.device, _UVA_PROBE_BYTES, 1, 3)
        reads = checkpoint_reads(prepared.path, shape.stack_name)
        return cls(prepared, shape, timer, reads, uva)

    def time_compute(
        self, batches: list[int] | None = None, warmup: int = 1, repeats: int = 5
    ) -> None:
        """Time compute at `batches` (default: the workload's) and keep the figures."""
        batches = list(batches or self.prepared.workload.batch_sizes)
        layer_s, head_s = self.timer.time(batches, warmup=warmup, repeats=repeats)
        for batch, layer, head in zip(batches, layer_s, head_s, strict=True):
            self.layer_s.setdefault(batch, []).append(layer)
            self.head_s.setdefault(batch, []).append(head)

    def step_s(self) -> dict[int, float]:
        """Compute per decode step of the whole model at each batch: every layer as long
        as the timed one, plus the rest."""
        return {
            batch: self.shape.num_layers * statistics.median(self.layer_s[batch])
            + statistics.median(self.head_s[batch])
            for batch in self.layer_s
        }

    def measurements(self, limits: Limits, disk_gb_per_s: float | None = None) -> Measurements:
        """The planner's `Measurements` of this run: medians of every timing of compute
        and of the run's link and disk rates (`disk_gb_per_s` in place of the disk's,
        where given: reads from the page cache, which compute does not slow)."""
        batches = sorted(self.layer_s)
        return self._measurements(
            batches,
            [statistics.median(self.layer_s[b]) for b in batches],
            [statistics.median(self.head_s[b]) for b in batches],
            _rates(limits, self.prepared.device, statistics.median),
            disk_gb_per_s,
        )

    def measure_copies(self, limits: Limits, batch: int) -> None:
        """On a CPU, the prefetch backend's copy rate between a forward's layers now (a
        cut model as long as the compute probe's longer one, every layer streamed), added
        to `limits`; the planner takes it as the link of a CPU's copies."""
        if self.prepared.device.type != "cpu":
            return
        if self.copies is None:
            count = self.timer.count + self.timer.extra
            self.copies = ForwardCopies(
                self.prepared.path, self.shape, self.prepared.device, self.timer.context_len, count
            )
        rate = statistics.median(self.copies.gb_per_s(batch) for _ in range(_COPY_REPEATS))
        limits.forward_copy_samples_gb_per_s.append(rate)

    def close(self) -> None:
        if self.copies is not None:
            self.copies.close()

    def time_now(self, batch: int) -> None:
        """Time compute at `batch` now, just before a run it is set against."""
        self.time_compute([batch], warmup=0, repeats=_PAIRED_REPEATS)

    def predict_latest(
        self, limits: Limits, layout: Layout, batch: int, reads_page_cache: bool
    ) -> float:
        """The planner's step for `layout` at `batch` from the last timing of compute at
        `batch` and each rate's median over its last `_RATE_WINDOW` measurements (taken just
        before and just after the run predicted: a single short measurement of this VM's
        disk dips now and then); disk layers read through the page cache
        (`reads_page_cache`) go at the page cache's rate."""
        disk = limits.page_cache_read_gb_per_s if reads_page_cache else None
        latest = self._measurements(
            [batch],
            [self.layer_s[batch][-1]],
            [self.head_s[batch][-1]],
            _rates(limits, self.prepared.device, _around),
            disk,
        )
        found = evaluate(self.shape, latest, UNLIMITED, layout, batch, kv_offload=False)
        assert found is not None, "an unlimited budget fits every layout"
        return found.time.step_s

    def _measurements(
        self,
        batches: list[int],
        layer_s: list[float],
        head_s: list[float],
        rates: tuple[float, float, float],
        disk_gb_per_s: float | None,
    ) -> Measurements:
        link, disk, busy = rates
        return Measurements(
            machine=machine_name(self.prepared.device),
            software=software(),
            device_type=self.prepared.device.type,
            model_digest=self.shape.digest,
            dtype=str(self.shape.dtype).removeprefix("torch."),
            context_len=self.timer.context_len,
            batch_sizes=batches,
            layer_s=layer_s,
            head_s=head_s,
            link_gb_per_s=link,
            disk_gb_per_s=disk_gb_per_s or disk,
            uva_gb_per_s=self.uva_gb_per_s,
            # Reads from the page cache are not slowed by compute.
            disk_busy_gb_per_s=0.0 if disk_gb_per_s else busy,
            disk_source="this run, read as the disk tier reads",
        )


def _around(samples: list[float]) -> float:
    """A rate around a run: the median of its last `_RATE_WINDOW` measurements."""
    return statistics.median(samples[-_RATE_WINDOW:])


def _generate_steps(prepared: Prepared) -> StepTimer:
    """Compute timed as the methods run: a decode step of transformers' `generate` (its
    dynamic cache, its logits processing) on the workload's prompts, the median of one
    call's steps. At batch 32 on this CPU that loop costs 5-7% more per step than the
    engine's static-cache step the planner times by default, at batch 1 and 8 about the
    same (docs/benchmarks.md)."""
    output_len = prepared.workload.output_len

    def timer(model: torch.nn.Module, batch: int) -> Callable[[], float]:
        ids = prepared.prompt_ids(batch)
        return lambda: statistics.median(
            greedy_decode(model, ids, output_len, prepared.device).step_s
        )

    return timer


def _rates(
    limits: Limits, device: torch.device, pick: Callable[[list[float]], float]
) -> tuple[float, float, float]:
    """(link, the disk read the disk tier's way, the same beside compute), each `pick`ed
    from its samples (0 where not measured): the link is the pinned host -> device copy
    on a GPU (measured once); on a CPU, the prefetch backend's copies in forwards."""

    def picked(samples: list[float]) -> float:
        return pick(samples) if samples else 0.0

    if device.type == "cuda":
        link = limits.h2d_pinned_gb_per_s or 0.0
    else:  # copies as they run in forwards where measured, else a memory copy
        link = (
            picked(limits.forward_copy_samples_gb_per_s)
            or picked(limits.memcpy_samples_gb_per_s)
            or limits.memcpy_gb_per_s
        )
    disk = picked(limits.disk_read_ways_gb_per_s.get(TIER_WAY, []))
    return link, disk, picked(limits.disk_busy_read_gb_per_s)
