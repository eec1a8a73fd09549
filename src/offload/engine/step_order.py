"""The compiled CPU decode step gives the eager step's bits: its sums and library
functions run ATen's kernels, as the eager step's do.

Inductor writes a reduction (a norm's mean, a softmax's sum) as a loop of its own, which
adds in another order than ATen's kernel; its vectorized exp, cos, log, tanh, erf, sqrt
are not ATen's; and it keeps a bfloat16 or float16 value in float32 between fused
operations where eager rounds after each one. transformers' attention of one new token is
another call traced than eager (the keys and values repeated per query head, `repeat_kv`,
where eagerly each KV head's query heads are its queries, `pack_gqa`). So a compiled step
parted from the eager one in the last bits (logprobs by up to 0.05 on the default model),
and an answer from the step it began with: a model runs eagerly while its step compiles in
the background (`step_jobs`), so a greedy answer depended on when it was asked.

In the compiled step, then, each such call of dynamo's graph becomes an opaque
`offload::eager_*` op that makes the eager step's ATen call (attention in its eager form),
and inductor rounds each elementwise result to its dtype as eager does
(`emulate_precision_casts`, `compile_options.COMPILE_OPTIONS`). The products are the same kernels
in both (`quant/row_dot`, `step_linears`). Left to inductor: casts, adds, products and
quotients of two values, `x * x`, rsqrt, silu, sigmoid, each one IEEE rounding or
measured the same (8M values a function and dtype). Costs the default model's lone step
~15% of its speed (docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import functools
import operator
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from offload.engine import prompt_attention
from offload.engine.graph_edits import Emitter, erase_unused, unrepeated
from offload.offloader.ops import define_op


def _reduce(x, mean: bool, dims: list[int], keepdim: bool, dtype):
    return (torch.mean if mean else torch.sum)(x, dims, keepdim, dtype=dtype)


def _softmax(x, dim: int, log: bool, dtype):
    return (torch.log_softmax if log else torch.softmax)(x, dim, dtype=dtype)


def _norm(x, shape: list[int], weight, bias, eps: float, rms: bool):
    if rms:
        return F.rms_norm(x, shape, weight, eps)
    return F.layer_norm(x, shape, weight, bias, eps)


def _attention(query, key, value, mask, is_causal: bool, scale, enable_gqa: bool):
    rows = query.shape[0] if query.dim() == 4 else 1
    kwargs = {"is_causal": is_causal, "scale": scale, "enable_gqa": enable_gqa}
    out = prompt_attention.step_attention(query, key, value, mask, **kwargs)
    if out is not None:  # (each query over its own columns: the eager step's call too)
        return out
    if rows == 1 or flash(query, key, value, mask, **kwargs):
        return F.scaled_dot_product_attention(query, key, value, mask, **kwargs)
    # One sequence at a time, as the eager step runs a batch (`invariant.RowByRow`): the
    # math kernel's batched products may sum a row otherwise than alone.
    rows_of = [[_row(x, rows, i) for x in (query, key, value, mask)] for i in range(rows)]
    return torch.cat([F.scaled_dot_product_attention(*row, **kwargs) for row in rows_of])


def flash(query, *args, **kwargs) -> bool:
    """Whether ATen runs attention of these arguments (`F.scaled_dot_product_attention`'s)
    in its CPU flash kernel, which computes each sequence's heads apart in one order
    whatever the batch (measured: 756 shapes at 1, 2 and 16 threads, batched and row by row
    the same bits), so that a batch needs no split: where MKL's sums there do not depend on
    which thread makes them (`mkl_reproducible`)."""
    choice = torch._fused_sdp_choice(query, *args, **kwargs)
    return (
        query.device.type == "cpu"
        and choice == SDPBackend.FLASH_ATTENTION.value
        and mkl_reproducible()
    )


@functools.cache
def mkl_reproducible() -> bool:
    """Whether MKL runs in a conditional-reproducibility mode (`MKL_CBWR`, set by
    `offload/__init__.py` before MKL's first call), in which its sums do not depend on their
    buffers' alignment. Without it, on an AMD EPYC, ATen's flash kernel gave a sequence other
    bits at 2 threads in a batch than alone (its per-thread buffers lie elsewhere): a batch
    is then attended one sequence at a time, which gives a sequence's bits alone. False
    where torch has no MKL or its mode cannot be read (unknown: split)."""
    if not torch.backends.mkl.is_available():
        return False
    try:  # (MKL is linked into libtorch_cpu; its service call answers the mode in effect)
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", _TORCH_CPU))
        get = lib.mkl_serv_cbwr_get
    except (OSError, AttributeError):
        return False
    get.argtypes, get.restype = [ctypes.c_int], ctypes.c_int
    return get(_CBWR_BRANCH) not in (_CBWR_OFF, _CBWR_BRANCH_OFF)


_TORCH_CPU = "libtorch_cpu.so"
_CBWR_BRANCH, _CBWR_OFF, _CBWR_BRANCH_OFF = 1, 0, 1  # (mkl_cbwr.h)


def _row(x, rows: int, index: int):
    if x is not None and x.dim() >= 1 and x.shape[0] == rows:
        return x[index : index + 1]
    return x  # (a mask broadcast over the batch)


def _math(x, name: str, approximate: str):
    if name == "gelu":
        return F.gelu(x, approximate=approximate)
    return (getattr(F, name) if name in _ACTIVATIONS else getattr(torch, name))(x)


def _attention_fake(query, key, value, mask, is_causal, scale, enable_gqa):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


def _like(x, *args):
    return torch.empty_like(x)


REDUCE = define_op(
    "eager_reduce",
    "(Tensor x, bool mean, int[] dims, bool keepdim, ScalarType? dtype) -> Tensor",
    _reduce,
    _reduce,
)
SOFTMAX = define_op(
    "eager_softmax",
    "(Tensor x, int dim, bool log, ScalarType? dtype) -> Tensor",
    _softmax,
    _softmax,
)
NORM = define_op(
    "eager_norm",
    "(Tensor x, int[] shape, Tensor? weight, Tensor? bias, float eps, bool rms) -> Tensor",
    _norm,
    _like,
)
ATTENTION = define_op(
    "eager_attention",
    "(Tensor query, Tensor key, Tensor value, Tensor? mask, bool is_causal, float? scale, "
    "bool enable_gqa) -> Tensor",
    _attention,
    _attention_fake,
)
MATH = define_op("eager_math", "(Tensor x, str name, str approximate) -> Tensor", _math, _like)
POW = define_op("eager_pow", "(Tensor x, float exponent) -> Tensor", torch.pow, _like)

# The library functions whose bits inductor's differ from ATen's (measured: exp, log, cos,
# sin, tanh, erf, gelu, sqrt; the rest of their kind with them). Not silu and sigmoid: the
# same bits in 8M values of each dtype, and 30 calls a step of the default model.
_TORCH = ("exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sin", "cos", "tan", "asin",
          "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "erf", "erfc",
          "erfinv", "sqrt")  # fmt: skip
_ACTIVATIONS = ("gelu", "mish", "softplus", "elu", "selu", "celu", "logsigmoid")
_FUNCTIONS = {getattr(torch, n): n for n in _TORCH} | {getattr(F, n): n for n in _ACTIVATIONS}
_FUNCTIONS |= {getattr(torch.special, n): n for n in ("erf", "erfc", "expm1", "exp2", "log1p")}
_FUNCTIONS |= {F.tanh: "tanh"} | {n: n for n in _TORCH + _ACTIVATIONS}
_REDUCTIONS = {torch.mean: True, torch.sum: False, "mean": True, "sum": False}
_SOFTMAXES = {torch.softmax: False, F.softmax: False, torch.log_softmax: True,
              F.log_softmax: True, "softmax": False, "log_softmax": True}  # fmt: skip
_POWS = (torch.pow, operator.pow, "pow")
_ATTENTION = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


def eager_order(graph: torch.fx.Graph) -> int:
    """Replace each call of a CPU step's dynamo graph whose bits inductor would change by
    its `offload::eager_*` op (the module's docstring); the number replaced."""
    replaced = 0
    for node in list(graph.nodes):
        call = _call(node)
        if call is None:
            continue
        emit = Emitter(graph, node.args[0].meta["example_value"].fake_mode)
        with graph.inserting_before(node):
            out = _emit_attention(emit, call[1]) if call[0] is ATTENTION else emit(*call)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        if call[0] is ATTENTION:
            for tensor in (call[1]["key"], call[1]["value"]):
                erase_unused(graph, tensor)
        replaced += 1
    graph.lint()
    return replaced


def _call(node: torch.fx.Node) -> tuple | None:
    """(op, its arguments...) that does what `node` does as eager does it (for attention:
    `ATTENTION` and the call's arguments by name); None where `node` is none of them, or
    is called in a way the op does not take (inductor computes it then)."""
    target = _target(node)
    first = node.args[0] if node.args else None
    if target is None or not isinstance(first, torch.fx.Node):
        return None
    x = first.meta.get("example_value")
    if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or not x.is_floating_point():
        return None
    if _in(target, _FUNCTIONS):
        given = _given(node, ("input",), {"approximate", "inplace"})
        if given is None or given.get("inplace"):
            return None
        return MATH, first, _FUNCTIONS[target], given.get("approximate", "none")
    if _in(target, _POWS):
        given = _given(node, ("input", "exponent"), set())
        exponent = None if given is None else given.get("exponent")
        if type(exponent) not in (int, float) or exponent in (1, 2):
            return None  # (x, x * x: no rounding or one, as ATen's)
        return POW, first, float(exponent)
    if _in(target, _REDUCTIONS):
        given = _given(node, ("input", "dim", "keepdim"), {"dtype"})
        dims = None if given is None else _dims(given.get("dim"), x.dim())
        if dims is None:
            return None
        keepdim = bool(given.get("keepdim", False))
        return REDUCE, first, _REDUCTIONS[target], dims, keepdim, given.get("dtype")
    if _in(target, _SOFTMAXES):
        given = _given(node, ("input", "dim"), {"dtype", "_stacklevel"})
        if given is None or type(given.get("dim")) is not int:
            return None
        return SOFTMAX, first, given["dim"], _SOFTMAXES[target], given.get("dtype")
    if target in (F.layer_norm, F.rms_norm):
        return _norm_call(node, x, rms=target is F.rms_norm)
    if target is F.scaled_dot_product_attention:
        given = _given(node, _ATTENTION, {"enable_gqa"})
        if given is None or given.get("dropout_p", 0.0) != 0.0:
            return None
        return ATTENTION, given
    return None


def _norm_call(node: torch.fx.Node, x: torch.Tensor, rms: bool) -> tuple | None:
    names = ("input", "normalized_shape", "weight", *(("eps",) if rms else ("bias", "eps")))
    given = _given(node, names, set())
    if given is None or not all(type(n) is int for n in given.get("normalized_shape", ())):
        return None
    eps = given.get("eps", None if rms else 1e-5)
    eps = torch.finfo(x.dtype).eps if eps is None else eps  # (rms_norm's default)
    shape = list(given["normalized_shape"])
    return NORM, node.args[0], shape, given.get("weight"), given.get("bias"), float(eps), rms


def _emit_attention(emit: Emitter, given: dict) -> torch.fx.Node:
    """An attention call as the eager step makes it. For one query position transformers
    calls it eagerly with each KV head's query heads as its queries (`pack_gqa`: [b,
    kv_heads, groups, d] against the keys and values as cached) but traced repeats the
    keys and values per query head (`repeat_kv`), which ATen's kernel sums otherwise: the
    traced form is written back as the eager one."""
    query, key, value, mask = (given.get(name) for name in _ATTENTION[:4])
    rest = (bool(given.get("is_causal", False)), given.get("scale"))
    rest = (*rest, bool(given.get("enable_gqa", False)))
    q = query.meta["example_value"]
    keys, values = unrepeated(key), unrepeated(value)
    packed = q.dim() == 4 and q.shape[2] == 1 and not rest[2]
    packed = packed and keys is not key and values is not value
    if packed:
        kv_heads = keys.meta["example_value"].shape[1]
        groups = q.shape[1] // kv_heads
        query = emit(torch.reshape, query, (-1, kv_heads, groups, q.shape[-1]))
        if isinstance(mask, torch.fx.Node) and mask.meta["example_value"].shape[1] != 1:
            width = mask.meta["example_value"].shape[-1]  # (a mask per head, packed alike)
            mask = emit(torch.reshape, mask, (-1, kv_heads, groups, width))
        key, value = keys, values
    out = emit(ATTENTION, query, key, value, mask, *rest)
    if packed:  # (back to [b, heads, 1, d], as transformers reshapes the eager output)
        out = emit(torch.reshape, out, (-1, q.shape[1], 1, value.meta["example_value"].shape[-1]))
    return out


def _target(node: torch.fx.Node):
    """A call's function, or a method's name (`Tensor.mean` called as a function too)."""
    if node.op == "call_method":
        return node.target
    if node.op != "call_function":
        return None
    name = getattr(node.target, "__name__", "")
    return name if getattr(torch.Tensor, name, None) is node.target else node.target


def _in(target, table) -> bool:
    try:
        return target in table
    except TypeError:  # (an unhashable target)
        return False


def _given(node: torch.fx.Node, names: tuple[str, ...], optional: set) -> dict | None:
    """A call's arguments by name; None where it passes one not in `names` or `optional`."""
    if len(node.args) > len(names):
        return None
    given = dict(zip(names, node.args, strict=False)) | dict(node.kwargs)
    return None if set(given) - {*names, *optional} else given


def _dims(dim, rank: int) -> list[int] | None:
    """A reduction's dims as a list (empty: every dim); None where one is not a constant."""
    if dim is None:
        return []
    dims = [dim] if type(dim) is int else list(dim)
    if not all(type(d) is int for d in dims):
        return None
    return [d % rank for d in dims] if rank else dims
