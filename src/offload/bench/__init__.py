"""`offload bench`: one workload through every offloading method side by side, beside the
bounds of this machine measured in the same run."""
