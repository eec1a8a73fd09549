"""The linears of a compiled CPU decode step (`cpu_step`), written so that each reads its
weight once, as stored, at the memory's rate.

Inductor's own lowering of `F.linear` calls MKL: for one row its one-thread
matrix-vector product (below the memory's rate: docs/benchmarks.md, "2026-11-27
(thirteenth session): one-row products at the read rate (issue 28)"), for 2 to ~64 rows
`x @ weight.T`, which repacks the whole weight every call. Written instead as
`(x * weight).sum(-1)`, the product of one row becomes one generated loop over the
weight's rows, split across the OpenMP threads; a few rows go to `weight @ x.T`
(`cpu_linear.WEIGHT_TIMES`), as the eager step has them.

bfloat16 and float16 weights take the same forms. Inductor upcasts a reduced-precision
load to float32 in registers, so the one-row loop reads the weight's 2 bytes a value,
multiplies and accumulates in float32 vectors and rounds each output once (the generated
C++: `convert<float,2,at::BFloat16,1>` of each 32-value load, a `VectorizedN<float,2>`
accumulator); the eager `F.linear` of bf16 rounds the same way, at the end. For a few
rows, `weight @ x.T` of bf16 runs oneDNN's bf16 kernel (AVX512-BF16 dot products where
the CPU has them, float32 sums) on the weight as stored.

Where the row-invariant kernels are built (`quant/row_dot`: the default on a CPU), every
row count of those dtypes is instead one opaque `offload::row_linear` call: each output one
dot product in one fixed order, so a row's bits do not depend on its batch (the forms above
are the fallback where no C compiler works).

Each output element is one row's sum in one kernel, so the bits depend on the kernel, not
on where the weight lives: offloaded (prefetch slots, the disk tier) gives the resident
compiled step's bits; with `row_dot`'s products, the eager step's (`step_order`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._inductor.inductor_prims import force_stride_order
from torch._subclasses.fake_tensor import FakeTensor

from offload.engine import cpu_linear
from offload.engine.graph_edits import Emitter
from offload.quant import row_dot

# The dtypes whose products the step writes out: activations and weight alike.
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def step_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor | None:
    """`F.linear` as the compiled step writes it (a float dtype of `FLOATS` on a CPU, plain
    tensors: fake ones while compiling): `row_dot.ROW_LINEAR` where built, else one row as
    `(x * weight).sum(-1)`, 2 to
    `cpu_linear.MAX_ROWS` as `weight @ x.T` (as the eager step has them,
    `cpu_linear.few_rows_linear`); None where `F.linear` should run."""
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
    if x_value.dtype in row_dot.USED_TYPES and row_dot.library() is not None:
        # (every row count: one fixed order per output, `quant/row_dot`)
        calls = [(torch.reshape, (_X, (-1, width))), (row_dot.ROW_LINEAR, (_X, weight))]
    elif x_value.numel() == width:  # one row: one loop over the weight's rows, across threads
        # (x in a buffer of its own: else inductor computes it where the loop reads it, the
        # norm before the product again for each of the weight's rows)
        calls = [(torch.reshape, (_X, (1, -1))), (force_stride_order, (_X, (width, 1))),
                 (torch.mul, (_X, weight)), (torch.sum, (_X, -1))]  # fmt: skip
    elif x_value.dtype == torch.float32:  # MKL with the weight as stored (x @ weight.T
        # repacks it every call)
        calls = [(torch.reshape, (_X, (-1, width))), (torch.t, (_X,)),
                 (cpu_linear.WEIGHT_TIMES, (weight, _X)), (torch.t, (_X,))]  # fmt: skip
    else:
        calls = [(torch.reshape, (_X, (-1, width))), (cpu_linear.HALVES_TIMES_WEIGHT, (_X, weight))]
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
    return x.dtype == weight.dtype and x.dtype in FLOATS


def step_products(graph: torch.fx.Graph) -> int:
    """Rewrite each `F.linear` of 1 to `cpu_linear.MAX_ROWS` rows of a dtype of `FLOATS`
    in dynamo's graph as `step_linear`; the number rewritten. Done on the graph, not by a
    TorchFunctionMode: dynamo traced every torch call of the step through such a mode,
    half of its tracing time (docs/benchmarks.md, "2026-11-27 (fifteenth session): the
    compiled step kept on disk, and three of its costs")."""
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
