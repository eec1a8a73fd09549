"""The decode step of one sequence on a CPU, compiled (inductor), with each linear of its
one row written as a multiply and a sum.

Eagerly a step of the default model in float32 spends ~17 ms in its products (at the read
rate, `cpu_linear`) and ~19 ms in the ~1,200 other ATen calls and the Python of
transformers' modules around them. Compiled, those fuse into a few C++ loops; and where
inductor would call MKL's one-thread matrix-vector product for `F.linear`, the product
written as `(x * weight).sum(-1)` becomes one generated loop over the weight's rows,
split across the OpenMP threads, which reads each weight once at the memory's rate
(measured on the 2-core AVX2 machine: eager 16 tok/s, compiled as it is 19, compiled with
the products so written 41; llama.cpp on the same float32 bytes 52).

Each output element is one row's sum in that loop, so the bits depend on the kernel, not on
where the weight lives: a compiled step offloaded (prefetch slots, the disk tier) gives
the same bits as the compiled step resident. They may differ from the eager step's.

The graph is specialised to its shapes (`dynamic=False`: kernels with constant sizes); the
cache's length is one of them, so `LLM` rounds it up to a power of two (`cache_length`):
a handful of compiles serve every prompt. Each step is compiled ahead of time and kept on
disk (`step_cache`): a second process loads it in ~2 s instead of tracing it again (~7 s).
Steps offloaded by prefetch or the disk tier are kept too (their hooks name the
offloader by id, `ops.register`). Where a step cannot be kept (a graph break: KV offload;
module units' read checks in its guards) dynamo traces it in each process, and inductor's
own cache spares the compile.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os

import torch
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._subclasses.fake_tensor import FakeTensor

from offload.engine import cpu_linear, step_attention
from offload.engine.step_attention import Emitter, rewrite_attention
from offload.model.quantized import Int4Linear, Q8Linear

log = logging.getLogger(__name__)

MIN_CACHE_LENGTH = 128  # the smallest cache a compiled step is built for
# "0": every CPU decode step eager, as enforce_eager (the suite's); "wait": a step's first
# call compiles it (tests that need the compiled bits from the first step); else in the
# background (`step_jobs`), its steps eager until it is ready.
ENV = "OFFLOAD_CPU_COMPILE"


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def cache_length(length: int, max_model_len: int) -> int:
    """The static cache's length for a compiled step of `length` positions: the next
    power of two (at least `MIN_CACHE_LENGTH`), never past `max_model_len`, never short."""
    rounded = MIN_CACHE_LENGTH
    while rounded < length:
        rounded *= 2
    return max(length, min(rounded, max_model_len))


def pays(model: torch.nn.Module) -> bool:
    """Whether a compiled step pays for `model`: where its float32 linears are large enough
    that a step is their reading (`cpu_linear.pays`), or where its int4 and q8 weights kept
    as stored would be as large in float32 (their products stay opaque ops, the rest of
    the step fuses around them; a q8 product of one row becomes one loop,
    `quant_layouts.q8_one_row`). Measured on the 2-core machine, the default model as
    stored: eager 43.5 tok/s, compiled 71.1."""
    if cpu_linear.pays(model):
        return True
    stored = (m for m in model.modules() if isinstance(m, (Int4Linear, Q8Linear)))
    floats = sum(m.in_features * m.out_features * 4 for m in stored)
    return floats >= cpu_linear.PAYS_BYTES


def step_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor | None:
    """`F.linear` as the compiled step writes it (float32 on a CPU, plain tensors: fake
    ones while compiling): one row as `(x * weight).sum(-1)`, 2 to `cpu_linear.MAX_ROWS`
    as `weight @ x.T` (as the eager step has them, `cpu_linear.few_rows_linear`); None
    where `F.linear` should run."""
    if not _rewritten(x, weight):
        return None
    out = x
    for function, rest in _linear_calls(x, weight, bias):
        out = function(*(out if arg is _X else arg for arg in rest))
    return out


_X = object()  # where a call of `_linear_calls` takes the value so far


def _linear_calls(x, weight, bias) -> list[tuple]:
    """`step_linear`'s calls in turn, each with its arguments, `_X` for the value so far
    (`x`, `weight`: tensors, fake tensors, or graph nodes with the fake values as
    `example_value`)."""
    x_value = x.meta["example_value"] if isinstance(x, torch.fx.Node) else x
    weight_value = weight.meta["example_value"] if isinstance(weight, torch.fx.Node) else weight
    # (-1 for the leading size: a step of dynamic rows, `rows.RowStep`, has a symbol there)
    shape = (-1, *x_value.shape[1:-1], weight_value.shape[0])
    width = x_value.shape[-1]
    if x_value.numel() == width:  # one row: one loop over the weight's rows, across threads
        calls = [(torch.reshape, (_X, (1, -1))), (torch.mul, (_X, weight)), (torch.sum, (_X, -1))]
    else:  # MKL's product with the weight as stored (x @ weight.T repacks it every call)
        calls = [(torch.reshape, (_X, (-1, width))), (torch.t, (_X,)),
                 (cpu_linear.WEIGHT_TIMES, (weight, _X)), (torch.t, (_X,))]  # fmt: skip
    calls.append((torch.reshape, (_X, shape)))
    return calls if bias is None else [*calls, (torch.add, (_X, bias))]


def _rewritten(x, weight) -> bool:
    plain = (torch.Tensor, torch.nn.Parameter, FakeTensor)
    if type(weight) not in plain or type(x) not in plain:
        return False  # a tensor subclass (a quantized weight) keeps its own kernel
    if x.device.type != "cpu" or weight.dim() != 2 or not x.dim():
        return False
    if not 1 <= x.numel() // max(x.shape[-1], 1) <= cpu_linear.MAX_ROWS:
        return False
    return x.dtype == torch.float32 and weight.dtype == torch.float32


def step_products(graph: torch.fx.Graph) -> int:
    """Rewrite each `F.linear` of 1 to `cpu_linear.MAX_ROWS` float32 rows in dynamo's
    graph as `step_linear`; the number rewritten. Done on the graph, not by a
    TorchFunctionMode: dynamo traced every torch call of the step through such a mode,
    half of its ~6 s of tracing."""
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not F.linear or node.kwargs:
            continue
        x, weight, bias = (*node.args, None)[:3]
        if not all(isinstance(arg, torch.fx.Node) for arg in (x, weight)):
            continue
        if not _rewritten(x.meta.get("example_value"), weight.meta.get("example_value")):
            continue
        with graph.inserting_before(node):
            out = _emit(graph, x, weight, bias)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        rewritten += 1
    graph.lint()
    return rewritten


def _emit(graph: torch.fx.Graph, x, weight, bias) -> torch.fx.Node:
    """The nodes of `step_linear(x, weight, bias)`, each with its fake value."""
    emit, node = Emitter(graph, x.meta["example_value"].fake_mode), x
    for function, rest in _linear_calls(x, weight, bias):
        node = emit(function, *(node if arg is _X else arg for arg in rest))
    return node


class _ProductsPass(CustomGraphPass):
    """`step_products` and `step_attention.rewrite_attention` as inductor's pass over
    dynamo's graph (before autograd)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        step_products(graph)
        rewrite_attention(graph)

    def uuid(self) -> str:
        return rewrite_digest()


@functools.cache
def rewrite_digest() -> str:
    """The rewrite's source: inductor's cache keys and the saved steps' names hold it."""
    functions = (step_linear, _rewritten, _linear_calls, step_products, _emit)
    source = "".join(inspect.getsource(function) for function in functions)
    source += inspect.getsource(step_attention)
    return hashlib.sha256(source.encode()).hexdigest()


# (Without inductor's checks of its buffers' sizes, strides and alignment in the step's
# wrapper: ~1,100 Python calls a step, 4% of it at batch 1. The guards check the inputs.)
COMPILE_OPTIONS = {
    "pre_grad_custom_pass": _ProductsPass(),
    "size_asserts": False,
    "alignment_asserts": False,
}
