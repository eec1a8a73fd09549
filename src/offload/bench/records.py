"""What `offload bench` gives back, typed: one `Record` per method and batch size, the plan
against the hand settings, the workload as run, and the whole `BenchResult`, which is plain
JSON through `to_dict` (the field names are the JSON's keys)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from offload.planner.measurements import Measurements
from offload.probes.limits import Limits


@dataclass(frozen=True)
class Record:
    """The figures of one method at one batch size: decode speed (tokens/s = batch /
    median step, its spread over the rounds), bytes offloaded and moved per forward by
    link, stall, memory, whether its tokens are the reference's, its bound, and the
    planner's prediction (None where the planner has no such layout)."""

    method: str
    label: str
    is_ours: bool
    setting: dict[str, Any]  # the method's own settings, as it names them
    batch: int
    tokens_per_s: float
    tokens_per_s_min: float
    tokens_per_s_max: float
    step_s: float
    step_s_min: float
    step_s_max: float
    prefill_s: float
    round_step_s: list[float]
    offloaded_bytes: int
    moved_bytes_per_forward: float
    moved_bytes_per_forward_by_link: dict[str, float]
    achieved_gb_per_s: float
    stall_s_per_step: float | None
    peak_device_bytes: int | None
    peak_rss_bytes: int
    load_s: float
    load_rss_bytes: int
    load_device_bytes: int | None
    same_tokens: bool | None
    compute_s: float | None
    bound_step_s: float | None
    bound_limit: str
    bound_link_s: dict[str, float]
    bound_tokens_per_s: float | None
    step_over_bound: float | None
    predicted_step_s: float | None = None
    predicted_over_step: float | None = None
    round_predicted_s: list[float] = dataclasses.field(default_factory=list)
    # On a CPU: the weights' bytes over the memory read rate (a step reads each weight once),
    # over the step: the fraction of that floor the method reaches (None on a GPU).
    of_read_bound: float | None = None


@dataclass(frozen=True)
class PlanAgainstHand:
    """At one batch, the plan's tokens/s beside the best of our hand settings that fit the
    plan's budgets, and the median over rounds of the plan's speed over the best's."""

    batch: int
    fitting: list[str]
    plan_tokens_per_s: float
    best_hand: str | None
    best_hand_tokens_per_s: float | None
    plan_over_best_hand: float | None
    plan_over_best_hand_rounds: list[float]


@dataclass(frozen=True)
class RunWorkload:
    """The workload as it ran: the model, its sizes, and the settings of the run."""

    model: str
    path: str
    dtype: str
    device: str
    batch_sizes: list[int]
    prompt_len: int
    output_len: int
    rounds: int
    total_bytes: int
    num_layers: int
    layer_bytes: list[int]
    checkpoint_bytes: int
    quantization: str | None = None  # "gguf": the weights as stored (bytes: stored bytes)


@dataclass(frozen=True)
class Compute:
    """Compute per decode step at each batch size, and where the figure came from."""

    source: str
    step_s: dict[int, float]


@dataclass(frozen=True)
class BenchResult:
    workload: RunWorkload
    limits: Limits
    compute: Compute
    planner: Measurements | None  # the planner's view of the run (None: no prediction)
    reference: str | None  # whose tokens the others are compared with
    skipped: dict[str, str]  # method -> why it did not run
    records: list[Record]
    plan_against_hand: list[PlanAgainstHand]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchResult:
        """A result read back from `to_dict`'s JSON (keys it does not know, such as the
        machine that `offload bench` adds, are left out)."""
        planner = data["planner"]
        return cls(
            workload=RunWorkload(**data["workload"]),
            limits=Limits.from_dict(data["limits"]),
            compute=Compute(
                data["compute"]["source"],
                {int(batch): s for batch, s in data["compute"]["step_s"].items()},
            ),
            planner=Measurements(**planner) if planner is not None else None,
            reference=data["reference"],
            skipped=data["skipped"],
            records=[Record(**record) for record in data["records"]],
            plan_against_hand=[PlanAgainstHand(**row) for row in data["plan_against_hand"]],
        )
