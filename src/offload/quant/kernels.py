"""The products of quantized weights as stored (and the row lookups of tables kept so):
eager functions, and each one opaque op under torch.compile (`stored_op`). The tensors
they read are laid out once (`layouts.py`; GGUF's blocks: `gguf_quants`; the packed
formats: `packed_quant`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F

from offload.offloader.ops import define_op
from offload.quant import row_dot
from offload.quant.gguf_quants import FORMATS, dequantize
from offload.quant.layouts import GROUP, q4_values, q8_values
from offload.quant.packed_quant import packed_linear, packed_linear_op


def stored_op(op: str, x: torch.Tensor, *stored: object) -> torch.Tensor:
    """What a module computes from its stored weight, by `op`: a product of x [rows, in]
    ("q4", "int4", "q8"; "gguf": GGUF's blocks (with the type's name and the bias) de-quantized,
    then `F.linear` on x of any shape; "packed": a safetensors format's tensors, its form
    and the bias, `packed_quant`), or the float32 rows of a table that ids [...] look
    up ("q8_rows", "gguf_rows"). Under torch.compile each is one opaque op: inductor may
    not re-lay out what it computes inside, nor fuse it with what follows (a multiply
    fused with a later add becomes one rounding, not two), so a compiled model gives the
    same bits wherever its weights came from. One exception: a q8 product of one row on a
    CPU is written out (`q8_one_row`), so that inductor reads the int8 weight once in one
    loop instead of widening each block column to float32 for MKL."""
    if torch.compiler.is_compiling():
        if op == "q8" and x.shape[0] == 1 and x.device.type == "cpu" and not _row_dot_built():
            return q8_one_row(x, *stored)
        if op == "int4":  # (its casts fused into the kernels around: docs/benchmarks.md)
            return _OPAQUE[op](x.to(torch.bfloat16), *stored).to(x.dtype)
        return _OPAQUE[op](x, *stored)
    return _EAGER[op](x, *stored)


def _row_dot_built() -> bool:
    """Whether the row-invariant products are built (a constant to a trace: dynamo warns
    when it traces into `row_dot.library`'s functools cache)."""
    return row_dot.library() is not None


# What `torch.compiler.assume_constant_result` sets, without its import of dynamo at the
# package's import (tests/quant/test_kernels_import.py checks both; `compile_options`).
_row_dot_built._dynamo_marked_constant = True  # type: ignore[attr-defined]


def q8_one_row(
    x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None
) -> torch.Tensor:
    """`q8_matmul` of x [1, in], as plain tensor operations for a compiled step: each block
    column's 32 products summed, scaled, then the columns summed. Inductor makes of it a
    loop over the int8 weight at the memory's rate (the eager form widens each column to
    float32: 113 MB written a step for the default model's head; docs/benchmarks.md). The
    sums' order is the kernel's, so its bits may differ from the eager product's (as the
    compiled float32 step's do); it is the same in a compiled offloaded step, whose weights
    are inputs of the same loop (tests/engine/test_cpu_step.py). x is put in a buffer
    first: else inductor computes it where the loop reads it, the model's last norm again
    for every block of outputs (the default model's head several times slower so, for the
    same bits; docs/benchmarks.md)."""
    from torch._inductor import inductor_prims

    x = inductor_prims.force_stride_order(x, (x.shape[-1], 1))
    columns = x.reshape(values.shape[0], 1, values.shape[-1])
    parts = (columns * values.to(x.dtype)).sum(-1) * scales.to(x.dtype)  # [blocks, out]
    if offsets is not None:  # (each offset times its group's inputs' sum)
        parts = parts + columns.sum(-1) * offsets.to(x.dtype)
    return parts.sum(0, keepdim=True)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """x [rows, in] (any float dtype) times an int4 weight: bfloat16 activations, as the
    kernel takes them; the result in x's dtype."""
    out = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, GROUP, scale_zero)
    return out.to(x.dtype)


def q4_matmul(
    x: torch.Tensor, nibbles: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """x [rows, in] times a q4 weight: the integer products of `row_dot.q4_linear` (each
    row's bits whatever the rows beside it), or where its library is missing (a folder
    converted on a machine with it), `F.linear` of the weight's float32 values."""
    if row_dot.library() is not None and x.device.type == "cpu":
        return row_dot.q4_linear(x, nibbles, scales, offsets)
    return F.linear(x, q4_values(nibbles, scales, offsets).to(x.dtype))


def int4_cuda_matmul(
    x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor
) -> torch.Tensor:
    """x [rows, in] times a weight in the GPU's int4 packing (bfloat16 activations)."""
    out = torch.ops.aten._weight_int4pack_mm(
        x.to(torch.bfloat16).contiguous(), packed, GROUP, scale_zero
    )
    return out.to(x.dtype)


Q8_FEW_ROWS = 8  # up to this many rows a slice is the whole weight (measured: no faster)
_apart = threading.local()  # .on: `rows_apart`


@contextlib.contextmanager
def rows_apart():
    """Inside, a q8 product of a few rows computes each row as a one-row product does
    (the same ops on the same shapes: its bits), each block column widened once for all
    of them: a speculative verify forward's positions as the one-row decode steps they
    stand for (MKL rounds a 32-long dot product by how many rows share the call)."""
    previous = getattr(_apart, "on", False)
    _apart.on = True
    try:
        yield
    finally:
        _apart.on = previous


Q8_SLICE = 16384  # weight rows


def q8_matmul(
    x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None
) -> torch.Tensor:
    """x [rows, in] times a q8 weight, one block column at a time (a scratch of one column,
    never the whole weight in float), in x's dtype. One path for any number of rows: torch's
    int8 kernel is faster for one row but rounds the activations to bfloat16, so a row's
    logits would depend on how many rows share its step (docs/design.md). Past
    `Q8_FEW_ROWS` rows, a slice of `Q8_SLICE` weight rows at a time, so that the sums stay
    in the cache: the default model's head at 32 and 64 rows several times faster
    (docs/benchmarks.md, "2026-11-28 (twenty-first session): the server's few-row steps,
    and the default model's steps as stored (issue 28)"; each output's sums are the same,
    so are its bits)."""
    if row_dot.q8_fits(x, values):  # (each row's bits whatever the rows beside it)
        return row_dot.q8_linear(x, values, scales, offsets)
    columns = x.reshape(x.shape[0], values.shape[0], values.shape[-1]).transpose(0, 1)
    sums_in = None if offsets is None else columns.sum(-1).T  # [rows, blocks]
    if x.shape[0] > 1 and getattr(_apart, "on", False):  # (any count: a verify of many)
        return _q8_rows_apart(x, columns, sums_in, values, scales, offsets)
    slice_rows = values.shape[1] if x.shape[0] <= Q8_FEW_ROWS else Q8_SLICE
    out = x.new_empty(x.shape[0], values.shape[1])
    for start in range(0, values.shape[1], slice_rows):
        end = start + slice_rows
        sums = out[:, start:end]
        weights = zip(columns, values[:, start:end], scales[:, start:end], strict=True)
        for i, (column, q, d) in enumerate(weights):
            part = torch.mm(column, q.to(x.dtype).T).mul_(d.to(x.dtype))
            if i:
                sums.add_(part)
            else:
                sums.copy_(part)
        if sums_in is not None:  # (each offset times its group's inputs' sum)
            sums.add_(torch.mm(sums_in, offsets[:, start:end].to(x.dtype)))
    return out


def _q8_rows_apart(x, columns, sums_in, values, scales, offsets) -> torch.Tensor:
    """`q8_matmul` of each row as if alone (`rows_apart`)."""
    out = x.new_empty(x.shape[0], values.shape[1])
    rows = [out[row : row + 1] for row in range(x.shape[0])]
    for i, (column, q, d) in enumerate(zip(columns, values, scales, strict=True)):
        weight, scale = q.to(x.dtype).T, d.to(x.dtype)
        for row, sums in enumerate(rows):
            part = torch.mm(column[row : row + 1], weight).mul_(scale)
            if i:
                sums.add_(part)
            else:
                sums.copy_(part)
    if sums_in is not None:
        widened = offsets.to(x.dtype)
        for row, sums in enumerate(rows):
            sums.add_(torch.mm(sums_in[row : row + 1], widened))
    return out


def gguf_linear(
    x: torch.Tensor, raw: torch.Tensor, kind: str, bias: torch.Tensor | None
) -> torch.Tensor:
    """`F.linear` with the float32 weight GGUF's blocks give (then x's dtype)."""
    return F.linear(x, dequantize(raw, kind).to(x.dtype), bias)


def _gguf_step_linear(
    x: torch.Tensor, raw: torch.Tensor, kind: str, bias: torch.Tensor | None
) -> torch.Tensor:
    """`gguf_linear` in a compiled step: its product as the eager decode step's
    (`row_dot.step_linear`)."""
    return row_dot.step_linear(x, dequantize(raw, kind).to(x.dtype), bias)


def q8_rows(
    ids: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None
) -> torch.Tensor:
    flat = ids.reshape(-1)
    return q8_values(
        values[:, flat], scales[:, flat], None if offsets is None else offsets[:, flat]
    )


def gguf_rows(ids: torch.Tensor, raw: torch.Tensor, kind: str) -> torch.Tensor:
    return dequantize(raw[ids.reshape(-1)], kind)


# The opaque ops a compiled step calls (see `stored_op`), defined as offloader/ops.py
# defines its own: a compiled step of the default model as stored makes ~210 such calls.
def _int4_fake(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])


def _q4_fake(
    x: torch.Tensor, nibbles: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    return x.new_empty(x.shape[0], scales.shape[1])


def _int4_cuda_fake(
    x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor
) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0] * 8)


def _q8_fake(
    x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty(x.shape[0], values.shape[1])


def _gguf_fake(
    x: torch.Tensor, raw: torch.Tensor, kind: str, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], raw.shape[0])


def _q8_rows_fake(
    ids: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None
) -> torch.Tensor:
    return scales.new_empty(ids.numel(), values.shape[0] * values.shape[2], dtype=torch.float32)


def _gguf_rows_fake(ids: torch.Tensor, raw: torch.Tensor, kind: str) -> torch.Tensor:
    block = FORMATS[kind]
    width = raw.shape[-1] // block.block_bytes * block.block_size
    return raw.new_empty(ids.numel(), width, dtype=torch.float32)


_PRODUCT = "(Tensor x, Tensor weight, Tensor scales) -> Tensor"
_Q8 = "(Tensor x, Tensor weight, Tensor scales, Tensor? offsets) -> Tensor"
# Each product by its name (`layouts`' traits name them): its eager function, and its op.
_PRODUCTS: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]] = {
    "packed": (packed_linear, packed_linear_op),
    "int4": (int4_matmul, define_op("int4_matmul", _PRODUCT, int4_matmul, _int4_fake)),
    "q4": (
        q4_matmul,
        define_op(
            "q4_matmul",
            "(Tensor x, Tensor weight, Tensor scales, Tensor offsets) -> Tensor",
            q4_matmul,
            _q4_fake,
        ),
    ),
    "int4_cuda": (
        int4_cuda_matmul,
        define_op("int4_cuda_matmul", _PRODUCT, int4_cuda_matmul, _int4_cuda_fake),
    ),
    "q8": (q8_matmul, define_op("q8_matmul", _Q8, q8_matmul, _q8_fake)),
    "gguf": (
        gguf_linear,
        define_op(
            "gguf_linear",
            "(Tensor x, Tensor raw, str kind, Tensor? bias) -> Tensor",
            _gguf_step_linear,
            _gguf_fake,
        ),
    ),
    "q8_rows": (
        q8_rows,
        define_op(
            "q8_rows",
            "(Tensor ids, Tensor values, Tensor scales, Tensor? offsets) -> Tensor",
            q8_rows,
            _q8_rows_fake,
        ),
    ),
    "gguf_rows": (
        gguf_rows,
        define_op(
            "gguf_rows", "(Tensor ids, Tensor raw, str kind) -> Tensor", gguf_rows, _gguf_rows_fake
        ),
    ),
}
# (`stored_op` reads plain dicts of functions by a constant name, as dynamo guards them.)
_OPAQUE = {name: opaque for name, (_, opaque) in _PRODUCTS.items()}
_EAGER = {name: eager for name, (eager, _) in _PRODUCTS.items()}
