"""The planner (`offload plan`): measure this machine once per model shape (the link's and
the disk's bandwidths, a decoder layer's compute at each batch size), predict the decode
step of every placement with a cost model of the prefetch pipeline, and choose the one,
and the batch size, with the most tokens per second under the device and host budgets.

- `measure.py`: the measurements and their cache; `probes.py`, `compute.py`: how;
- `cost.py`: the cost model (pure functions); `shape.py`: a model's sizes.
"""
