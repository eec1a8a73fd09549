"""Measure this machine once (the link, the disk, a decode step's compute) and cache it:
the inputs of the planner, for `offload plan`, `cpu_offload_gb="auto"` and `offload bench`
alike. `measure.py`: the measurements and their cache; `bandwidth.py`: the link and disk
probes; `compute.py`: a decoder layer's compute, timed on cut models."""
