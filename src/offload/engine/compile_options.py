"""What inductor is told when it compiles a CPU decode step (`compiled_step`): the graph
pass that keeps the eager step's order and writes out its products (`step_order`,
`step_linears`), and the options around it. Apart from `cpu_step` so that importing the
package imports neither dynamo nor inductor: a process that never compiles imports them
later or not at all (`offload generate --enforce-eager` of the default model starts 0.3 s
sooner: 4.5 s against 4.8)."""

from __future__ import annotations

import functools
import hashlib
import inspect

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

from offload.engine import graph_edits, step_linears, step_order
from offload.engine.step_linears import step_products
from offload.quant import row_dot


class _ProductsPass(CustomGraphPass):
    """`step_order.eager_order` and `step_products` as inductor's pass over dynamo's graph
    (before autograd)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        # (counted beside dynamo's own counters: what a compile wrote out, for the tests)
        # (the eager step's calls first: the products written out after are inductor's)
        counters["offload"]["eager_order"] += step_order.eager_order(graph)
        counters["offload"]["products_rewritten"] += step_products(graph)

    def uuid(self) -> str:
        return rewrite_digest()


@functools.cache
def rewrite_digest() -> str:
    """The rewrite's source: inductor's cache keys and the saved steps' names hold it."""
    modules = (step_linears, step_order, graph_edits)
    source = "".join(inspect.getsource(module) for module in modules)
    source += f"row_dot={row_dot.library() is not None}"  # (which products it writes)
    return hashlib.sha256(source.encode()).hexdigest()


# (Without inductor's checks of its buffers' sizes, strides and alignment in the step's
# wrapper: they are Python calls, a share of the step's time at batch 1 (docs/benchmarks.md).
# The guards check the inputs.)
COMPILE_OPTIONS = {
    "pre_grad_custom_pass": _ProductsPass(),
    "size_asserts": False,
    "alignment_asserts": False,
    # (each elementwise result rounded to its dtype, as eager rounds it: `step_order`)
    "emulate_precision_casts": True,
}
