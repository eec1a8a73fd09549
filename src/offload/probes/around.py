"""Measurements around a run: for `offload bench`, which sets each timed run of a method
against the planner's prediction for that moment. A virtual machine's disk, memory and
compute speeds drift within minutes, so a prediction is fair only against rates of the
same moment: compute is timed at a batch just before the run (`time_now`), the rates a run
depends on are measured just before and just after it (`limits.py`, and `measure_copies`
here for a CPU's layer copies), and `latest` makes the planner's `Measurements` from those
around the run. Compute is timed with the planner's own probe (two models of the same
config cut to a few layers, random weights), each step as the caller's `step_timer` runs
one."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from offload.model.build import build_empty
from offload.planner.measurements import Measurements
from offload.planner.shape import ModelShape, shape_of
from offload.probes import link
from offload.probes.compute import CutFrom, DecodeTimer, ForwardCopies, StepTimer
from offload.probes.limits import TIER_WAY, Limits
from offload.probes.measure import checkpoint_reads, record
from offload.probes.settings import MeasureSettings

_PAIRED_REPEATS = 2
_RATE_WINDOW = 3  # a rate around a run: the median of its last measurements
_COPY_REPEATS = 3  # decode steps of the streamed cut model per measurement of its copies


@dataclass
class RunProbes:
    """The model's shape for the planner and its compute, every time it was timed (before
    each round at every batch, and before each run at its batch)."""

    path: Path
    device: torch.device
    batch_sizes: list[int]  # timed before each round
    settings: MeasureSettings  # how much the probes move, how often they repeat
    shape: ModelShape
    timer: DecodeTimer
    layer_reads: list | None  # the disk tier's reads, layer by layer (None: files in order)
    uva_gb_per_s: float = 0.0
    copies: ForwardCopies | None = None  # built when first needed (a CPU only)
    layer_s: dict[int, list[float]] = field(default_factory=dict)
    head_s: dict[int, list[float]] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        path: Path,
        dtype: torch.dtype,
        device: torch.device,
        context_len: int,
        batch_sizes: list[int],
        step_timer: StepTimer,
        settings: MeasureSettings,
    ) -> RunProbes:
        shape = shape_of(build_empty(path, dtype), context_len)
        timer = DecodeTimer(CutFrom(path, shape, device, context_len), step_timer=step_timer)
        uva = link.uva_gb_per_s(device, settings.copy_bytes, 1, 3)
        reads = checkpoint_reads(path, shape.stack_name)
        return cls(path, device, list(batch_sizes), settings, shape, timer, reads, uva)

    def time_compute(
        self, batches: list[int] | None = None, warmup: int = 1, repeats: int | None = None
    ) -> None:
        """Time compute at `batches` (default: every batch size; `repeats` default: the
        settings') and keep the figures."""
        batches = list(batches or self.batch_sizes)
        repeats = repeats or self.settings.repeats
        layer_s, head_s = self.timer.time(batches, warmup=warmup, repeats=repeats)
        for batch, layer, head in zip(batches, layer_s, head_s, strict=True):
            self.layer_s.setdefault(batch, []).append(layer)
            self.head_s.setdefault(batch, []).append(head)

    def time_now(self, batch: int) -> None:
        """Time compute at `batch` now, just before a run it is set against: two pairs of
        steps (the warm-ups were each round's); medians over the rounds."""
        self.time_compute([batch], warmup=0, repeats=_PAIRED_REPEATS)

    def step_s(self) -> dict[int, float]:
        """Compute per decode step of the whole model at each batch: every layer as long
        as the timed one, plus the rest."""
        return {
            batch: self.shape.num_layers * statistics.median(self.layer_s[batch])
            + statistics.median(self.head_s[batch])
            for batch in self.layer_s
        }

    def measure_copies(self, limits: Limits, batch: int) -> None:
        """On a CPU, the prefetch backend's copy rate between a forward's layers now (a
        cut model as long as the compute probe's longer one, every layer streamed), added
        to `limits`; the planner takes it as the link of a CPU's copies."""
        if self.device.type != "cpu":
            return
        if self.copies is None:
            count = self.timer.count + self.timer.extra
            source = CutFrom(self.path, self.shape, self.device, self.timer.context_len)
            self.copies = ForwardCopies(source, count)
        rate = statistics.median(self.copies.gb_per_s(batch) for _ in range(_COPY_REPEATS))
        limits.forward_copy_samples_gb_per_s.append(rate)

    def measurements(self, limits: Limits) -> Measurements:
        """The planner's `Measurements` of the whole run: medians of every timing of
        compute and of the run's link and disk rates."""
        batches = sorted(self.layer_s)
        return self._measurements(
            batches,
            [statistics.median(self.layer_s[b]) for b in batches],
            [statistics.median(self.head_s[b]) for b in batches],
            _rates(limits, self.device, statistics.median),
            None,
        )

    def latest(self, limits: Limits, batch: int, *, reads_page_cache: bool) -> Measurements:
        """The planner's `Measurements` around the last run at `batch`: the last timing of
        compute at `batch` and each rate's median over its last `_RATE_WINDOW`
        measurements (taken just before and just after the run: a single short measurement
        of a virtual disk dips now and then); disk layers read through the page cache
        (`reads_page_cache`) go at the page cache's rate."""
        return self._measurements(
            [batch],
            [self.layer_s[batch][-1]],
            [self.head_s[batch][-1]],
            _rates(limits, self.device, _around),
            limits.page_cache_read_gb_per_s if reads_page_cache else None,
        )

    def close(self) -> None:
        if self.copies is not None:
            self.copies.close()

    def _measurements(
        self,
        batches: list[int],
        layer_s: list[float],
        head_s: list[float],
        rates: tuple[float, float, float],
        page_cache_gb_per_s: float | None,
    ) -> Measurements:
        link_rate, disk_rate, busy = rates
        return record(
            self.device,
            self.shape,
            self.timer.context_len,
            batches,
            layer_s=layer_s,
            head_s=head_s,
            link_gb_per_s=link_rate,
            disk_gb_per_s=page_cache_gb_per_s or disk_rate,
            uva_gb_per_s=self.uva_gb_per_s,
            # Reads from the page cache are not slowed by compute.
            disk_busy_gb_per_s=0.0 if page_cache_gb_per_s else busy,
            disk_source="this run, read as the disk tier reads",
        )


def _around(samples: list[float]) -> float:
    """A rate around a run: the median of its last `_RATE_WINDOW` measurements."""
    return statistics.median(samples[-_RATE_WINDOW:])


def _rates(
    limits: Limits, device: torch.device, pick: Callable[[list[float]], float]
) -> tuple[float, float, float]:
    """(link, the disk read the disk tier's way, the same beside compute), each `pick`ed
    from its samples (0 where not measured): the link is the pinned host -> device copy
    on a GPU (measured once); on a CPU, the prefetch backend's copies in forwards."""

    def picked(samples: list[float]) -> float:
        return pick(samples) if samples else 0.0

    if device.type == "cuda":
        link_rate = limits.h2d_pinned_gb_per_s or 0.0
    else:  # copies as they run in forwards where measured, else a memory copy
        link_rate = (
            picked(limits.forward_copy_samples_gb_per_s)
            or picked(limits.memcpy_samples_gb_per_s)
            or limits.memcpy_gb_per_s
        )
    disk_rate = picked(limits.disk_read_ways_gb_per_s.get(TIER_WAY, []))
    return link_rate, disk_rate, picked(limits.disk_busy_read_gb_per_s)
