"""The planner's prediction of each of our methods' decode step, from measurements taken in
the same run as the methods: a virtual machine's disk and memory speeds drift from one
minute to the next, so a prediction is fair only against rates of the same minutes. The
rates are the run's `Limits` (memory copy or host -> device link, the disk read the way
the disk tier reads); compute comes from the planner's own probe (two models of the same
config cut to a few layers, random weights), timed before every round beside the disk."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from offload.bench.limits import Limits
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


@dataclass
class PlannerInputs:
    """The model's shape for the planner and its compute, timed once per round."""

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

    def time_compute(self) -> None:
        batches = list(self.prepared.workload.batch_sizes)
        layer_s, head_s = self.timer.time(batches)
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
        """The planner's `Measurements` of this run: medians of the rounds' compute, the
        run's link and disk rates (`disk_gb_per_s` in place of the disk's, where given:
        reads from the page cache, which compute does not slow)."""
        device = self.prepared.device
        batches = sorted(self.layer_s)
        link = limits.h2d_pinned_gb_per_s if device.type == "cuda" else limits.memcpy_gb_per_s
        busy = 0.0 if disk_gb_per_s else limits.tier_disk_busy_gb_per_s()
        return Measurements(
            machine=machine_name(device),
            software=software(),
            device_type=device.type,
            model_digest=self.shape.digest,
            dtype=str(self.shape.dtype).removeprefix("torch."),
            context_len=self.timer.context_len,
            batch_sizes=batches,
            layer_s=[statistics.median(self.layer_s[b]) for b in batches],
            head_s=[statistics.median(self.head_s[b]) for b in batches],
            link_gb_per_s=link or 0.0,
            disk_gb_per_s=disk_gb_per_s or limits.tier_disk_gb_per_s() or 0.0,
            uva_gb_per_s=self.uva_gb_per_s,
            disk_busy_gb_per_s=busy or 0.0,
            disk_source="this run, read as the disk tier reads",
        )


def predicted_step_s(
    inputs: PlannerInputs, limits: Limits, layout: Layout, batch: int, reads_page_cache: bool
) -> float:
    """The planner's step for `layout` at `batch` (disk layers read through the page
    cache, where `reads_page_cache`, at the run's page cache rate)."""
    disk = limits.page_cache_read_gb_per_s if reads_page_cache else None
    measured = inputs.measurements(limits, disk)
    found = evaluate(inputs.shape, measured, UNLIMITED, layout, batch, kv_offload=False)
    assert found is not None, "an unlimited budget fits every layout"
    return found.time.step_s
