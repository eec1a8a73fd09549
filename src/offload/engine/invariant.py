"""Batch invariance (vLLM's `VLLM_BATCH_INVARIANT=1`): a sequence's logits, and so its
tokens and logprobs, bit for bit the same whether it runs alone or beside any others.

Three things make a sequence's numbers depend on its batch, and each is taken away:
- **A product's rounding depends on how many rows it has.** BLAS libraries pick a kernel
  by the row count: on the 2-core x86 machine MKL's float32 `F.linear` rounds a row one
  way alone, another among 2-3 rows, a third among 4 or more; past a few rows every row
  rounds alike, but only where their count is a multiple of the kernel's block (4 there: a
  fifth row takes the tail's path). `row_multiple` finds that multiple on the machine, for
  the model's dtype and shapes, and `pad_products` makes every linear (plain, stored and
  packed alike) run a multiple of it, padding with zero rows that are then dropped.
- **A group's prefill pads prompts to one width**, which moves a prompt's columns and so
  how attention's sums group them: in this mode each request prefills alone, its prompt
  at column 0 (`scheduler.Scheduler`).
- **Attention's kernel splits its work by the batch**: ATen's CPU attention of one new
  token computes a sequence alone differently from the same sequence among others (it
  divides the columns between threads when there are few sequences). `RowByRow` runs it
  one sequence at a time, over every column of the row (the engine passes them all).
- **Product kernels chosen by row count** (the few-row `weight @ x.T`, the compiled
  step's one-row loops): off in this mode; every step runs the same eager products.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from offload.engine import prompt_attention, step_order
from offload.errors import ConfigError
from offload.sizes import compute_dtype

ENV = "VLLM_BATCH_INVARIANT"  # vLLM's switch, read as the default of `batch_invariant`
_MULTIPLES = (1, 2, 4, 8, 16, 32, 64)  # row counts tried, smallest first
_TIMES = (1, 2, 3, 5, 8, 16, 32)  # each tried at these multiples of it
_MAX_ROWS = 256


def from_env() -> bool:
    return os.environ.get(ENV, "0") not in ("", "0")


def linears(model: nn.Module) -> list[nn.Module]:
    """The modules that compute `x @ weight.T` over a last dimension: `nn.Linear` and the
    stored and packed forms (each has `in_features` and `out_features`)."""
    return [
        module
        for module in model.modules()
        if isinstance(module, nn.Linear)
        or (hasattr(module, "in_features") and hasattr(module, "out_features"))
    ]


def row_multiple(model: nn.Module, device: torch.device, dtype: torch.dtype | None = None) -> int:
    """The fewest rows T such that `F.linear` of `dtype` on `device` rounds a row the same
    in every product of a multiple of T rows, wherever the row is, for every weight shape
    of `model`'s linears (random values of those shapes); a clear error where no T up to
    64 does. `dtype` None: the model's compute dtype."""
    dtype = dtype or compute_dtype(model)
    shapes = sorted({(m.out_features, m.in_features) for m in linears(model)})
    multiple = 1
    for shape in shapes:
        found = _multiple_of(shape, device, dtype)
        if found is None:
            raise ConfigError(
                f"batch_invariant: on {device} the {dtype} products of a {shape[0]}x{shape[1]} "
                f"weight round a row differently by the number of rows beside it, whatever "
                f"multiple of up to {_MULTIPLES[-1]} rows is tried; batch invariance is not "
                f"available on this machine"
            )
        multiple = max(multiple, found)
    return multiple


@functools.cache
def _multiple_of(shape: tuple[int, int], device: torch.device, dtype: torch.dtype) -> int | None:
    """A row's rounding depends on the kernel the row count picks and on the row's place
    (a block of the kernel's rows, or the tail past the last whole block), not on the other
    rows' values: the same row repeated shows each place's rounding (`_cancelling`)."""
    weight, row = _cancelling(shape, device, dtype)
    with torch.inference_mode():
        for multiple in _MULTIPLES:
            if _alike(lambda x: F.linear(x, weight), row[0], multiple):
                return multiple
    return None


def _cancelling(shape: tuple[int, int], device: torch.device, dtype: torch.dtype):
    """A weight and a row whose products sum to almost nothing: each output is what is
    left of partial sums far larger than it, so any change in the order of the sums shows
    in its bits, even rounded to bfloat16 (random values hide most: a sum that ends 2^-16
    away from where another order ends rounds to the same bfloat16)."""
    generator = torch.Generator().manual_seed(0)
    row = torch.randn(shape[1], generator=generator, dtype=torch.float64)
    weight = torch.randn(shape, generator=generator, dtype=torch.float64)
    if shape[1] > 1:
        weight[:, -1] = -(weight[:, :-1] @ row[:-1]) / row[-1]
    return weight.to(device, dtype), row[None].to(device, dtype)


def pad_products(model: nn.Module, multiple: int, probe_stored: bool = False) -> None:
    """Every linear of `model` runs a multiple of `multiple` rows (zero rows added, their
    outputs dropped); 1: as it is. `probe_stored`: a stored or packed module computing in
    float32 whose weights are in place (a resident model) gets the multiple its own kernel
    needs, tried on it (the CPU int4 kernel rounds a row alike at any count: 1, where the
    float32 `F.linear` needs 4)."""
    found: dict[tuple, int] = {}
    for module in linears(model):
        if getattr(module, "_rows_padded", False):  # (once; over any forward of its own)
            continue
        own = multiple
        if probe_stored and not isinstance(module, nn.Linear):
            key = _kernel_key(module)
            if key not in found:
                found[key] = _module_multiple(module)
            own = found[key] or multiple
        if own > 1:
            module.forward = functools.partial(_padded, module.forward, own)
        module._rows_padded = True


def _kernel_key(module: nn.Module) -> tuple:
    """What picks a stored module's kernel: its class, shape and stored kind."""
    kind = tuple(str(getattr(module, name, "")) for name in ("kind", "op", "form"))
    return (type(module).__name__, module.in_features, module.out_features, *kind)


def _module_multiple(module: nn.Module) -> int | None:
    """The fewest rows T such that `module` gives a row the same bits in every multiple of
    T rows, tried with random float32 rows (a float32 output shows a changed summation
    order, unlike bfloat16's); None where its inputs are not float32 or no T up to 64 does."""
    tensors = [*module.parameters(), *module.buffers()]
    device = tensors[0].device if tensors else torch.device("cpu")
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(2, module.in_features, generator=generator).to(device)
    with torch.inference_mode():
        try:
            if module(rows[:1]).dtype != torch.float32:
                return None
            for multiple in _MULTIPLES:
                if all(_alike(module, row, multiple) for row in rows):
                    return multiple
        except RuntimeError:  # (a kernel that takes no float32 input: the default multiple)
            return None
    return None


def _alike(product, row: torch.Tensor, multiple: int) -> bool:
    """Whether `product` gives `row` repeated the same bits in every row, at each count of
    `multiple` x `_TIMES` rows (up to `_MAX_ROWS`)."""
    first = None
    for times in _TIMES:
        count = multiple * times
        if count > _MAX_ROWS:
            break
        out = product(row[None].expand(count, -1).contiguous())
        first = out[0] if first is None else first
        if not bool((out == first).all()):
            return False
    return True


_decoding = threading.local()  # .on: the engine's thread runs a decode step (`decoding`)


@contextlib.contextmanager
def decoding(rows: int):
    """A decode step of `rows` sequences runs in here: its linears padded, its attention
    one sequence at a time. (A prefill needs neither: each request prefills alone, so its
    products are the same whatever runs beside it, and take the default kernels.)"""
    _decoding.on = True
    try:
        with RowByRow() if rows > 1 else contextlib.nullcontext():
            yield
    finally:
        _decoding.on = False


def _padded(forward, multiple: int, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // max(1, x.shape[-1])
    extra = -rows % multiple
    if not extra or not getattr(_decoding, "on", False):
        return forward(x)
    flat = x.reshape(rows, x.shape[-1])
    out = forward(torch.cat([flat, flat.new_zeros(extra, x.shape[-1])]))[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


class RowByRow(TorchFunctionMode):
    """Attention (`F.scaled_dot_product_attention`) of a batch run one sequence at a time,
    each as it runs alone (but in ATen's CPU flash kernel, where a row's bits do not depend
    on its batch: `step_order.flash`): the mode a batch-invariant forward runs in."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args and args[0].dim() == 4:
            rows = args[0].shape[0]
            if rows > 1 and not step_order.flash(*args, **kwargs):
                return torch.cat(
                    [
                        func(
                            *(_row(arg, rows, i) for arg in args),
                            **{key: _row(value, rows, i) for key, value in kwargs.items()},
                        )
                        for i in range(rows)
                    ]
                )
        return func(*args, **kwargs)


class StepAttention(RowByRow):
    """A CPU decode step's attention: each query over its own columns in the kernel a
    prompt's prefill takes (`prompt_attention.step_attention`), so a decoded token's keys
    and values have its prefill's bits; where the kernel does not take a call, ATen's, one
    sequence at a time if `apart` (`RowByRow`)."""

    def __init__(self, apart: bool):
        super().__init__()
        self.apart = apart

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            out = prompt_attention.step_attention(*args, **(kwargs or {}))
            if out is not None:
                return out
            if not self.apart:
                return func(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)


def _row(value, rows: int, index: int):
    """Sequence `index` of a batch's tensor ([rows, ...]); anything else as it is (a mask
    broadcast over the batch, a scale)."""
    if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == rows:
        return value[index : index + 1]
    return value
