"""The planner (`offload plan`): measure this machine once per model shape (the link's and
the disk's bandwidths, a decoder layer's compute at each batch size), predict the decode
step of every placement with a cost model of the prefetch pipeline, and choose the one,
and the batch size, with the most tokens per second under the device and host budgets.

- `measure.py`: the measurements and their cache; `probes.py`, `compute.py`: how;
- `cost.py`: the cost model (pure functions); `shape.py`: a model's sizes;
- `layouts.py`, `choose.py`: the placements weighed and the choice; `plan.py`: the plan
  and `plan_for`, the entry point; `flags.py`: the plan as flags, and its warnings;
- `command.py`: what `offload plan` prints.
"""

from offload.planner.measure import Measurements, MeasureSettings
from offload.planner.plan import Plan, plan_for

__all__ = ["MeasureSettings", "Measurements", "Plan", "plan_for"]
