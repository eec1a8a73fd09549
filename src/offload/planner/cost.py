"""The cost model: the predicted time of one decode step for a placement of the layers,
from measured rates. Pure functions, no tensors.

The step follows the prefetch pipeline (`offloader/prefetch.py`, `memory/slots.py`):
offloaded layers, in execution order, share `prefetch_step` device slots; layer p of them
uses slot p % step, and the slot is refilled with its next occupant as soon as layer p
has run. A layer waits (stalls) when its bytes have not landed: their copy was issued
too late (step 1: only after the previous occupant ran) or queued behind others.

Where bytes cost time:
- GPU: host -> device copies run one at a time on a copy stream, beside compute: bytes /
  link each. A layer on disk is read first (bytes / disk, reads one at a time too), then
  copied in.
- CPU: a host -> slot copy takes a core from compute: bytes / memcpy bandwidth add to the
  layer's compute. A layer read from disk with O_DIRECT lands in its slot on I/O threads,
  beside compute; while compute runs, the reads get the disk's rate measured beside
  compute (the I/O threads wait for the cores), else its rate alone.
- Mapped disk layers (DiskIO.MMAP, a warm page cache) are computed on in place: nothing
  beyond compute.
- UVA: kernels read the bytes they touch over the link as they run, which lengthens the
  layer: touched bytes / UVA bandwidth, sharing the link with the copies (on a CPU host
  memory is the device's: nothing).
- A KV cache in host memory comes in over the same copy queue, a ring of `kv_slots`.

The step is the steady state: the last of a few simulated forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

from offload.memory.kv_shape import KV_SLOTS
from offload.memory.placement import Placement
from offload.memory.slots import next_in_slot, num_slots

# What the planner weighs (pinning aside: a prefetch copy or a UVA read costs the same).
PLACES = (Placement.RESIDENT, Placement.HOST, Placement.DISK, Placement.MAPPED, Placement.UVA)
_FORWARDS = 3  # the first forward fills the pipeline; the last is the steady state


@dataclass(frozen=True)
class Rates:
    """Measured rates, GB/s (1e9 bytes). `link_gb_per_s`: host -> device copies (pinned,
    copy engine) on a GPU, a memory copy on a CPU; `uva_gb_per_s`: kernels reading host
    memory in place (0: the link's rate); `disk_busy_gb_per_s`: the disk read while the
    CPU computes (0: as fast as alone)."""

    on_gpu: bool
    link_gb_per_s: float
    disk_gb_per_s: float
    uva_gb_per_s: float = 0.0
    disk_busy_gb_per_s: float = 0.0

    @property
    def disk_slowdown(self) -> float:
        """The share of a CPU's disk read time lost while it computes (0 on a GPU)."""
        if self.on_gpu or not 0 < self.disk_busy_gb_per_s < self.disk_gb_per_s:
            return 0.0
        return 1.0 - self.disk_busy_gb_per_s / self.disk_gb_per_s


@dataclass(frozen=True)
class LayerCost:
    """One layer of a step: its compute, where its weights are, the bytes that cost time
    (moved in for HOST/DISK, touched in place for UVA, none for RESIDENT and MAPPED) and the bytes of its KV cache brought in from host memory (0: on device)."""

    compute_s: float
    place: Placement = Placement.RESIDENT
    num_bytes: int = 0
    kv_bytes: int = 0

    def __post_init__(self) -> None:
        if self.place not in PLACES:
            raise ValueError(f"place must be one of {', '.join(PLACES)}, got {self.place!r}")
        object.__setattr__(self, "place", Placement(self.place))  # a string, parsed
        if self.compute_s < 0 or self.num_bytes < 0 or self.kv_bytes < 0:
            raise ValueError(
                f"compute_s, num_bytes and kv_bytes must be >= 0, got {self.compute_s}, "
                f"{self.num_bytes}, {self.kv_bytes}"
            )


@dataclass(frozen=True)
class StepTime:
    """A predicted step: `step_s` with its parts, per step: `compute_s` of the layers and
    the head; `link_s` the link's busy time (copies beside compute, and UVA reads and CPU
    copies that hold compute up); `disk_s` the disk's; `stall_s` the time compute waited
    for bytes that had not landed."""

    step_s: float
    compute_s: float
    stall_s: float
    link_s: float
    disk_s: float

    @property
    def bound_s(self) -> float:
        return max(self.compute_s, self.link_s, self.disk_s)

    @property
    def limit(self) -> str:
        """What sets the bound: "compute", "link" or "disk"."""
        parts = {"compute": self.compute_s, "link": self.link_s, "disk": self.disk_s}
        return max(parts, key=parts.__getitem__)


def transfer_s(num_bytes: float, gb_per_s: float) -> float:
    """Seconds to move `num_bytes` at `gb_per_s` (infinite without a rate)."""
    if num_bytes <= 0:
        return 0.0
    return num_bytes / (gb_per_s * 1e9) if gb_per_s > 0 else float("inf")


def touched_share(num_experts: int, experts_per_token: int, batch: int) -> float:
    """The expected share of a mixture-of-experts layer's experts that a decode step of
    `batch` tokens routes to (each token picks `experts_per_token` of `num_experts`,
    taken as uniform and independent): 1 - (1 - k/E)^batch."""
    if num_experts <= 0 or experts_per_token >= num_experts:
        return 1.0
    return 1.0 - (1.0 - experts_per_token / num_experts) ** batch


def predict_step(
    layers: list[LayerCost],
    head_s: float,
    rates: Rates,
    prefetch_step: int = 1,
    kv_slots: int = KV_SLOTS,
) -> StepTime:
    """The steady-state step of `layers` (in execution order) followed by `head_s` of
    compute outside them (embedding, final norm, lm_head), with offloaded layers sharing
    `prefetch_step` slots and KV caches in host memory sharing `kv_slots`."""
    if prefetch_step < 1 or kv_slots < 1:
        raise ValueError(
            f"prefetch_step and kv_slots must be >= 1, got {prefetch_step}, {kv_slots}"
        )
    pipeline = _Pipeline(layers, rates, prefetch_step, kv_slots)
    ends = [0.0]
    for forward in range(_FORWARDS):
        for index in range(len(layers)):
            pipeline.run(forward, index)
        pipeline.now += head_s
        pipeline.compute[forward] += head_s
        ends.append(pipeline.now)
    last = _FORWARDS - 1
    return StepTime(
        step_s=ends[-1] - ends[-2],
        compute_s=pipeline.compute[last],
        stall_s=pipeline.stall[last],
        link_s=pipeline.link_busy[last],
        disk_s=pipeline.disk_busy[last],
    )


class _Ring:
    """Slots shared by `members` (layer indices, in order), as `SlotTable` runs them."""

    def __init__(self, members: list[int], step: int):
        self.members = members
        self.slots = num_slots(len(members), step)
        self.position = {layer: p for p, layer in enumerate(members)}

    def after(self, position: int, forward: int) -> tuple[int, int] | None:
        """The (forward, position) loaded once `position` has run (None: its slot has no
        other occupant and stays loaded)."""
        following = next_in_slot(position, len(self.members), self.slots)
        if following == position:
            return None
        return (forward if following > position else forward + 1), following

    def serving(self, position: int, forward: int) -> int:
        """The forward whose load `position` reads: a slot's only occupant keeps the
        bytes of the first forward."""
        alone = next_in_slot(position, len(self.members), self.slots) == position
        return 0 if alone else forward


class _Pipeline:
    """Compute, the copy queue and the disk over a few forwards (the times of `predict_step`)."""

    def __init__(self, layers: list[LayerCost], rates: Rates, step: int, kv_slots: int):
        self.layers, self.rates = layers, rates
        self.weights = _Ring(
            [i for i, c in enumerate(layers) if c.place in (Placement.HOST, Placement.DISK)], step
        )
        self.kv = _Ring([i for i, c in enumerate(layers) if c.kv_bytes], kv_slots)
        self.now = 0.0
        self.link_free = self.disk_free = 0.0
        self.ready: dict[tuple[str, int, int], float] = {}
        self.compute, self.stall = [0.0] * _FORWARDS, [0.0] * _FORWARDS
        self.link_busy, self.disk_busy = [0.0] * (_FORWARDS + 1), [0.0] * (_FORWARDS + 1)
        for ring, kind in ((self.weights, "weights"), (self.kv, "kv")):
            for position in range(ring.slots):  # before the first forward, as post_init
                self._load(kind, ring, 0, position, 0.0)

    def run(self, forward: int, index: int) -> None:
        cost = self.layers[index]
        for ring, kind in ((self.weights, "weights"), (self.kv, "kv")):
            if index in ring.position:
                position = ring.position[index]
                landed = self.ready[kind, ring.serving(position, forward), position]
                self.stall[forward] += max(0.0, landed - self.now)
                self.now = max(self.now, landed)
        if cost.place == Placement.UVA and self.rates.on_gpu:
            self._read_in_place(forward, cost)
        serial = self._copied_on_compute_cores(cost)
        self._slow_reads(forward, cost.compute_s + serial)
        self.now += cost.compute_s + serial
        self.compute[forward] += cost.compute_s
        self.link_busy[forward] += serial
        for ring, kind in ((self.weights, "weights"), (self.kv, "kv")):
            if index in ring.position:
                following = ring.after(ring.position[index], forward)
                if following is not None:
                    self._load(kind, ring, *following, self.now)

    def _read_in_place(self, forward: int, cost: LayerCost) -> None:
        """UVA on a GPU: the layer's kernels read its bytes over the link, which the copy
        queue also uses: the reads wait for the copies queued before them, and hold the
        layer up while they last."""
        rate = self.rates.uva_gb_per_s or self.rates.link_gb_per_s
        start = max(self.now, self.link_free)
        self.stall[forward] += start - self.now
        self.link_free = start + transfer_s(cost.num_bytes, rate)
        self.link_busy[forward] += self.link_free - start
        self.now = self.link_free

    def _slow_reads(self, forward: int, busy_s: float) -> None:
        """A CPU computing for `busy_s` from now slows the disk reads under way: the reads
        pending (on a CPU only disk reads land in the future) land later by the time lost."""
        overlap = max(0.0, min(self.now + busy_s, self.disk_free) - self.now)
        delay = overlap * self.rates.disk_slowdown
        if delay <= 0:
            return
        self.disk_free += delay
        self.disk_busy[forward] += delay
        for key, landed in self.ready.items():
            if landed > self.now:
                self.ready[key] = landed + delay

    def _copied_on_compute_cores(self, cost: LayerCost) -> float:
        """A CPU copies host memory into its slots on the cores that compute."""
        if self.rates.on_gpu:
            return 0.0
        copied = cost.kv_bytes + (cost.num_bytes if cost.place == Placement.HOST else 0)
        return transfer_s(copied, self.rates.link_gb_per_s)

    def _load(self, kind: str, ring: _Ring, forward: int, position: int, issued: float) -> None:
        cost = self.layers[ring.members[position]]
        num_bytes = cost.kv_bytes if kind == "kv" else cost.num_bytes
        at = issued
        if kind == "weights" and cost.place == Placement.DISK:
            at = max(at, self.disk_free)
            self.disk_free = at + transfer_s(num_bytes, self.rates.disk_gb_per_s)
            self.disk_busy[forward] += self.disk_free - at
            at = self.disk_free
        if self.rates.on_gpu:  # then over the link, behind the copies queued before it
            at = max(at, self.link_free)
            self.link_free = at + transfer_s(num_bytes, self.rates.link_gb_per_s)
            self.link_busy[forward] += self.link_free - at
            at = self.link_free
        self.ready[kind, forward, position] = at
