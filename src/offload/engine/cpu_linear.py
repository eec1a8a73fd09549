"""A linear layer on a CPU: the row-invariant product (`quant/row_dot`) at any row count
where it is built, so that a row's bits do not depend on its batch; else as below, for 1 to
`MAX_ROWS` rows, `weight @ x.T` for a few rows and a batch of matrix-vector products for one.

`F.linear` asks MKL for `x @ weight.T`; for 2 to ~64 rows MKL's sgemm then repacks the
whole weight at every call, so a decode step of 4 rows costs twice one of 1 row though
it reads the same bytes. `weight @ x.T` streams the weight as stored (faster from 2 to 64
rows, no different at 1 row or at 96 and more; docs/benchmarks.md). The sums round differently
from `F.linear`'s, so a batch's tokens may differ from a lone run's; every offload mode
runs the same kernel, so offloaded still equals resident bitwise.

One row: MKL's float32 matrix-vector product streams the weight on one thread, below the
memory's rate; the same product as `torch.bmm` over the weight cut into row blocks runs
ATen's own kernel, faster for the head and the layers' matrices alike, on one thread too
(docs/benchmarks.md). Each output is one dot product in that kernel, so the bits do not
depend on the number of blocks or threads (any count from 2 gives the same), only on the
weight's row length.
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from offload.offloader.ops import define_op
from offload.quant import row_dot
from offload.sizes import compute_dtype

MAX_ROWS = 64  # above this `weight @ x.T` and F.linear agree in speed (F.linear is kept)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` on a CPU: `row_dot.row_linear` at any row count where it
    fits (float weights, plain tensors: a decode step of more than `MAX_ROWS` rows, a
    prompt's forward, each row's bits its own); else, for float32 and 1 to `MAX_ROWS` rows,
    `weight @ x.T` (2 or more rows) or a batch of matrix-vector products (1 row), where that
    is faster; None where `F.linear` should run."""
    if type(weight) not in (torch.Tensor, torch.nn.Parameter) or type(x) is not torch.Tensor:
        return None  # a tensor subclass (a quantized weight) keeps its own kernel
    if x.device.type != "cpu" or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    num_rows = x.numel() // max(x.shape[-1], 1)
    if num_rows and row_dot.fits(x, weight):  # (each row's bits whatever the rows beside it)
        return row_dot.row_linear(x, weight, bias)
    if not 1 <= num_rows <= MAX_ROWS:
        return None
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return None
    flat = x.reshape(num_rows, x.shape[-1])  # [rows, in]
    if num_rows == 1:
        blocks = _row_blocks(weight)
        if blocks is None:
            return None
        rows_in = weight.shape[1]
        column = flat.t().expand(blocks, rows_in, 1)  # [blocks, in, 1]
        out = torch.bmm(weight.view(blocks, -1, rows_in), column).view(1, -1)
    else:
        out = weight_times(weight, flat.t()).t().contiguous()  # [rows, out]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


ALIGNMENT = 64  # bytes: where the CPU allocator puts every tensor it makes


def weight_times(weight: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """`weight @ columns` ([out, in] @ [in, rows]) as MKL computes it for a weight at an
    `ALIGNMENT` boundary, wherever `weight` lies: MKL's sums over a weight 4 or 8 bytes
    off a 16-byte boundary round differently (measured: AVX2, 1536x576, 4 rows), and a
    tensor read or mapped from a safetensors file sits where its file offset puts it (the
    default model's: 40 bytes past a 64-byte boundary). Such a weight is copied to an
    aligned one first, so that a batch's products on the disk tier give the bits they give
    resident (a copy per product; the default model is written aligned, and pays none).
    The columns are laid out as `x.t()` of a contiguous `x` is, each row's values
    together: MKL's product over them stored the other way took several times as long
    (docs/benchmarks.md, "2026-11-28 (twenty-first session): the server's few-row steps,
    and the default model's steps as stored (issue 28)"), as a compiled step's down
    projection had them."""
    if weight.data_ptr() % ALIGNMENT:
        weight = torch.empty_like(weight, memory_format=torch.contiguous_format).copy_(weight)
    if columns.stride(0) != 1:  # (a compiled step may hand them over row-major)
        columns = columns.t().contiguous().t()
    return torch.mm(weight, columns)


def _weight_times_fake(weight: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    return weight.new_empty((weight.shape[0], columns.shape[1]))


# One opaque op in a compiled step: the weight's address is known only when it runs.
WEIGHT_TIMES = define_op(
    "weight_times", "(Tensor weight, Tensor columns) -> Tensor", weight_times, _weight_times_fake
)


def halves_times_weight(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(rows, weight)` ([rows, in] x [out, in] -> [rows, out]) of bfloat16 or
    float16, for a compiled step's 2 to `MAX_ROWS` rows: oneDNN's kernel on the weight as
    stored where the CPU has one for the dtype (`native_halves`: AVX-512 for bf16), else
    `UPCAST_SLICE_ROWS` weight rows at a time widened to float32 for MKL (ATen's own
    reduced-precision product is slow past a few rows, slower than a slice at a time from
    8 rows on; at 2 rows ATen's is the faster, so below `UPCAST_MIN_ROWS` it is kept;
    docs/benchmarks.md). A weight off an `ALIGNMENT` boundary is copied first, as in
    `weight_times`."""
    if weight.data_ptr() % ALIGNMENT:
        weight = torch.empty_like(weight, memory_format=torch.contiguous_format).copy_(weight)
    if native_halves(weight.dtype) or rows.shape[0] < UPCAST_MIN_ROWS:
        return F.linear(rows, weight)
    columns = rows.float().t()  # [in, rows], each row's values together (`weight_times`)
    sums = torch.empty(weight.shape[0], rows.shape[0])  # [out, rows]
    for start in range(0, weight.shape[0], UPCAST_SLICE_ROWS):
        end = start + UPCAST_SLICE_ROWS
        torch.mm(weight[start:end].float(), columns, out=sums[start:end])
    return rows.new_empty(rows.shape[0], weight.shape[0]).copy_(sums.t())


UPCAST_SLICE_ROWS = 256  # (2 MiB of float32 at 2048 inputs; 64 and 128 were slower)
UPCAST_MIN_ROWS = 4


@functools.cache
def native_halves(dtype: torch.dtype) -> bool:
    """Whether `F.linear` of `dtype` (bfloat16, float16) runs oneDNN's kernel on this CPU
    (on AVX-512 with BF16 it read a bf16 weight faster than `weight @ x.T` at 2 to 16 rows;
    docs/benchmarks.md)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def _halves_times_weight_fake(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return rows.new_empty((rows.shape[0], weight.shape[0]))


# One opaque op in a compiled step, as `WEIGHT_TIMES`.
HALVES_TIMES_WEIGHT = define_op(
    "halves_times_weight",
    "(Tensor rows, Tensor weight) -> Tensor",
    halves_times_weight,
    _halves_times_weight_fake,
)


def _row_blocks(weight: torch.Tensor) -> int | None:
    """How many row blocks a one-row product cuts `weight` into: one per thread (at least
    2, which is what takes ATen's kernel), where they divide its rows; None where the
    weight cannot be viewed so (F.linear runs)."""
    if not weight.is_contiguous():
        return None
    rows = weight.shape[0]
    for blocks in (max(torch.get_num_threads(), 2), 2):
        if rows % blocks == 0:
            return blocks
    return None


PAYS_BYTES = 16 * 2**20  # float32 linear weights above which the mode pays for itself


def kernels_for(model: torch.nn.Module, device: torch.device):
    """The context a CPU decode step of `model` runs in: `FewRowsLinear` where its float32
    `nn.Linear` weights (and the float weights its quantized modules de-quantize for
    `F.linear`: `linear_of_floats`) hold at least `PAYS_BYTES` (there the weights' streaming rate is
    the step's time), or where it has any float linear and the row-invariant products are
    built (a row's bits then do not depend on its batch); else nothing: the mode sees every
    torch call of the step, and a model of quantized weights only (the default model as
    stored) only pays its per-call cost (docs/benchmarks.md)."""
    if device.type != "cpu" or not (
        pays(model) or (_float_linears(model) and row_invariant(model))
    ):
        return contextlib.nullcontext()
    return FewRowsLinear()


def row_invariant(model: torch.nn.Module) -> bool:
    """Whether `model`'s decode steps on a CPU take the row-invariant products
    (`quant/row_dot`: float weights here, q8 ones in `quant/kernels`; torch's CPU int4
    kernel rounds a row alike at any count), so that a row's bits do not depend on its
    batch: where the kernels are built and the model computes in a dtype they take
    (`row_dot.USED_TYPES`: float32, as the stored and packed forms do, bfloat16, float16)."""
    known = _ROW_INVARIANT.get(model)
    if known is None:  # (once per model: asked at every decode step)
        known = _ROW_INVARIANT[model] = compute_dtype(model) in row_dot.USED_TYPES
    return known and row_dot.library() is not None


def _float_linears(model: torch.nn.Module) -> bool:
    """Whether `model` has float linears (`nn.Linear`, or modules that de-quantize for
    `F.linear`): else the mode only costs its per-call time."""
    known = _FLOAT_LINEARS.get(model)
    if known is None:
        known = _FLOAT_LINEARS[model] = any(
            type(m) is torch.nn.Linear or getattr(m, "linear_of_floats", False)
            for m in model.modules()
        )
    return known


_FLOAT_LINEARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ROW_INVARIANT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pays(model: torch.nn.Module) -> bool:
    """Whether `model`'s float32 linear weights (`nn.Linear`, and the `linear_of_floats`
    modules that de-quantize for `F.linear`) hold at least `PAYS_BYTES`."""
    known = _PAYS.get(model)
    if known is None:  # (once per model: a step should not walk its modules)
        floats = sum(
            m.in_features * m.out_features * 4
            for m in model.modules()
            if (type(m) is torch.nn.Linear and m.weight.dtype == torch.float32)
            or getattr(m, "linear_of_floats", False)  # (F.linear on a de-quantized weight)
        )
        known = _PAYS[model] = floats >= PAYS_BYTES
    return known


_PAYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class LinearMode(TorchFunctionMode):
    """While entered (in this thread only), every `F.linear` takes the class's `linear`
    where that gives a tensor (None: `F.linear` runs)."""

    def linear(self, *args, **kwargs) -> torch.Tensor | None:
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            out = self.linear(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


class FewRowsLinear(LinearMode):
    """`F.linear` as `few_rows_linear` where it applies."""

    def linear(self, *args, **kwargs) -> torch.Tensor | None:
        return few_rows_linear(*args, **kwargs)
