"""The planner (pure decision): from a model's shape, this machine's `Measurements` (made
by `offload.probes`) and the budgets, predict the decode step of every placement with a
cost model of the prefetch pipeline, and choose the one, and the batch size, with the most
tokens per second. It builds nothing: no offloader, no engine (`offload.llm.fit` checks a
model with its arithmetic).

- `shape.py`: a model's sizes; `fit.py`: the arithmetic of whether it fits a device budget;
- `measurements.py`: what the planner is given about a machine; `cost.py`: the cost model
  (pure functions);
- `layouts.py`, `choose.py`: the placements weighed and the choice; `plan.py`: the plan;
  `flags.py`: the plan as flags, and its warnings.

`offload.llm.auto.plan_for` measures and plans for a model named as `LLM` takes it.
"""

from offload.planner.measurements import Measured, Measurements
from offload.planner.plan import Plan, make_plan

__all__ = ["Measured", "Measurements", "Plan", "make_plan"]
