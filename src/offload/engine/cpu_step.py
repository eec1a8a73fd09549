"""The decode step of one sequence on a CPU, compiled (inductor), with each linear of its
one row written as a multiply and a sum.

Eagerly a step of the default model in float32 spends about as long in the ~1,200 other
ATen calls and the Python of transformers' modules around its products as in the products
themselves (at the read rate, `cpu_linear`; docs/benchmarks.md). Compiled, those fuse into
a few C++ loops; and where inductor would call MKL's one-thread matrix-vector product for
`F.linear`, the product written as `(x * weight).sum(-1)` becomes one generated loop over
the weight's rows, split across the OpenMP threads, which reads each weight once at the
memory's rate (compiled as it is, the step is barely faster than eager; with the products
so written, far faster, near llama.cpp on the same float32 bytes: docs/benchmarks.md,
"2026-11-27 (twelfth session): the set-up's torch in 3 s; where a CPU decode step goes").

Each output element is one row's sum in one kernel, so the bits depend on the kernel, not on
where the weight lives: a compiled step offloaded (prefetch slots, the disk tier) gives
the same bits as the compiled step resident; and where the row-invariant products are
built, the eager step's bits (`step_order`: its sums and library functions are ATen's).

The graph is specialised to its shapes (`dynamic=False`: kernels with constant sizes); the
cache's length is one of them, so `LLM` rounds it up to a power of two (`cache_length`):
a handful of compiles serve every prompt. Each step is compiled ahead of time and kept on
disk (`step_cache`): a second process loads it in a fraction of the time tracing it again
takes (docs/benchmarks.md). Steps offloaded by prefetch or the disk tier are kept too
(their hooks name the offloader by id, `ops.register`). Where a step cannot be kept (a
graph break: KV offload; module units' read checks in its guards) dynamo traces it in each
process, and inductor's own cache spares the compile.
"""

from __future__ import annotations

import logging
import os

import torch

from offload.engine import cpu_linear
from offload.quant.quantized import Int4Linear, Q4Linear, Q8Linear

log = logging.getLogger(__name__)

MIN_CACHE_LENGTH = 128  # the smallest cache a compiled step is built for
# "0": every CPU decode step eager, as enforce_eager (the suite's); "wait": a step's first
# call compiles it (tests that need the compiled bits from the first step); else in the
# background (`step_jobs`), its steps eager until it is ready.
ENV = "OFFLOAD_CPU_COMPILE"


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def may_compile(device: torch.device, enforce_eager: bool = False) -> bool:
    """Whether a model on `device` may compile its CPU decode step (where it pays)."""
    return device.type == "cpu" and not enforce_eager and enabled()


def cache_length(length: int, max_model_len: int) -> int:
    """The static cache's length for a compiled step of `length` positions: the next
    power of two (at least `MIN_CACHE_LENGTH`), never past `max_model_len`, never short."""
    rounded = MIN_CACHE_LENGTH
    while rounded < length:
        rounded *= 2
    return max(length, min(rounded, max_model_len))


def pays(model: torch.nn.Module) -> bool:
    """Whether a compiled step pays for `model`: where its float32 linears are large enough
    that a step is their reading (`cpu_linear.pays`), or where its bfloat16 and float16
    linears (written out as the float32 ones are, `step_linears`), or its 4-bit and q8
    weights kept as stored, would be as large in float32 (stored products stay opaque
    ops, the rest of the step fuses around them; a q8 product of one row becomes one loop,
    `kernels.q8_one_row`). The default model as stored decodes faster compiled than eager
    (docs/benchmarks.md, "2026-11-27 (sixteenth session): the stored model's step compiled;
    both issues' CPU checks again")."""
    if cpu_linear.pays(model):
        return True
    halves = (torch.bfloat16, torch.float16)
    counted = (
        m
        for m in model.modules()
        if isinstance(m, (Int4Linear, Q4Linear, Q8Linear))
        or (type(m) is torch.nn.Linear and m.weight.dtype in halves)
    )
    floats = sum(m.in_features * m.out_features * 4 for m in counted)
    return floats >= cpu_linear.PAYS_BYTES
