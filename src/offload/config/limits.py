"""The defaults and limits that several entry points share (`LLM`, the `offload` command,
the planner, `SamplingParams`): each is written here once and imported where it is used."""

from __future__ import annotations

# vLLM's default share of the device's memory that weights, KV cache and activations may use.
GPU_MEMORY_UTILIZATION = 0.9
# What `offload plan` weighs when not told: positions of context, and batch sizes up to this.
DEFAULT_CONTEXT_LEN = 1024
DEFAULT_MAX_BATCH = 64

# Counts reach torch and C as 64-bit integers: a larger one can only overflow there.
MAX_INT = 2**63 - 1
# GiB amounts become byte counts (64-bit integers); 4 EiB is beyond any machine.
MAX_GIB = 2**32

# What torch.manual_seed takes (an int64 or a uint64), as vLLM allows.
SEED_RANGE = (-(2**63), 2**64 - 1)

# `offload serve --max-request-bytes`: a request body at most this (vLLM has no such limit;
# a 20 MB prompt held the event loop for seconds).
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
