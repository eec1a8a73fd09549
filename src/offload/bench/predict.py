"""The planner's prediction of each of our methods' decode step, from measurements taken in
the same run as the methods: a virtual machine's disk, memory and compute speeds drift
within minutes, so a prediction is fair only against rates of the same moment. Before
each timed run of a method the runner measures the memory copy (and the disk, for a
method that reads it), and `predict_now` times compute at that batch with the planner's
own probe (two models of the same config cut to a few layers, random weights): each run
gets a prediction of its own moment, and a method's figure is the median over rounds of
predicted / measured (`results.prediction`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from offload.bench.limits import TIER_WAY, Limits
from offload.bench.workload import Prepared
from offload.model.build import build_empty
from offload.planner import probes
from offload.planner.choose import Budgets, evaluate
from offload.planner.compute import DecodeTimer
from offload.planner.layouts import Layout
from offload.planner.measure import Measurements, checkpoint_reads, machine_name, software
from offload.planner.shape import ModelShape, shape_of

UNLIMITED = Budgets(2**62, 2**62, 2**62)  # every layout fits: bench chose them by hand
_UVA_PROBE_BYTES = 256 * 2**20
_PAIRED_REPEATS = 3  # compute timed before each run: few pairs, medians over the rounds


@dataclass
class PlannerInputs:
    """The model's shape for the planner and its compute, every time it was timed (before
    each round at every batch, and before each run of ours at its batch)."""

    prepared: Prepared
    shape: ModelShape
    timer: DecodeTimer
    layer_reads: list | None  # the disk tier's reads, layer by layer (None: files in order)
    uva_gb_per_s: float = 0.0
    layer_s: dict[int, list[float]] = field(default_factory=dict)
    head_s: dict[int, list[float]] = field(default_factory=dict)

    @classmethod
    def of(cls, prepared: Prepared) -> PlannerInputs:
        work = prepared.workload
        context_len = work.prompt_len + work.output_len
        shape = shape_of(build_empty(prepared.path, prepared.dtype), context_len)
        timer = DecodeTimer(prepared.path, shape, prepared.device, context_len)
        uva = probes.uva_gb_per_s(prepared.device, _UVA_PROBE_BYTES, 1, 3)
        reads = checkpoint_reads(prepared.path, shape.stack_name)
        return cls(prepared, shape, timer, reads, uva)

    def time_compute(self, batches: list[int] | None = None, repeats: int = 5) -> None:
        """Time compute at `batches` (default: the workload's) and keep the figures."""
        batches = list(batches or self.prepared.workload.batch_sizes)
        layer_s, head_s = self.timer.time(batches, warmup=1, repeats=repeats)
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

    def predict_now(
        self, limits: Limits, layout: Layout, batch: int, reads_page_cache: bool
    ) -> float:
        """The planner's step for `layout` at `batch` from compute timed now and the
        rates measured last (the runner measures the memory copy, and the disk for a
        method that reads it, just before each run): a virtual machine's speed drifts
        within a round, so each timed run is set against a prediction of its own
        moment."""
        self.time_compute([batch], repeats=_PAIRED_REPEATS)
        return self.predict_latest(limits, layout, batch, reads_page_cache)

    def predict_latest(
        self, limits: Limits, layout: Layout, batch: int, reads_page_cache: bool
    ) -> float:
        """The planner's step for `layout` at `batch` from the last timing of compute at
        `batch` and the last measurement of each rate; disk layers read through the page
        cache (`reads_page_cache`) go at the page cache's rate."""
        disk = limits.page_cache_read_gb_per_s if reads_page_cache else None
        latest = self._measurements(
            [batch],
            [self.layer_s[batch][-1]],
            [self.head_s[batch][-1]],
            _rates(limits, self.prepared.device, lambda samples: samples[-1]),
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


def _rates(
    limits: Limits, device: torch.device, pick: Callable[[list[float]], float]
) -> tuple[float, float, float]:
    """(link, the disk read the disk tier's way, the same beside compute), each `pick`ed
    from its samples (0 where not measured): the link is the pinned host -> device copy
    on a GPU (measured once), the memory copy on a CPU."""

    def picked(samples: list[float]) -> float:
        return pick(samples) if samples else 0.0

    if device.type == "cuda":
        link = limits.h2d_pinned_gb_per_s or 0.0
    else:
        link = picked(limits.memcpy_samples_gb_per_s) or limits.memcpy_gb_per_s
    disk = picked(limits.disk_read_ways_gb_per_s.get(TIER_WAY, []))
    return link, disk, picked(limits.disk_busy_read_gb_per_s)
