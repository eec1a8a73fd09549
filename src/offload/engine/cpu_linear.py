"""A linear layer over a few rows on a CPU, as `weight @ x.T`.

`F.linear` asks MKL for `x @ weight.T`; for 2 to ~64 rows MKL's sgemm then repacks the
whole weight at every call, so a decode step of 4 rows costs twice one of 1 row though
it reads the same bytes. `weight @ x.T` streams the weight as stored (measured on the
2-core AVX2 machine, SmolLM2-135M's matrices, ms per step: 2 rows 85 -> 41, 16 rows
92 -> 66, 64 rows 233 -> 150; 1 row and >= 96 rows the same). The sums round differently
from `F.linear`'s, so a batch's tokens may differ from a lone run's; every offload mode
runs the same kernel, so offloaded still equals resident bitwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

MAX_ROWS = 64  # above this the two agree in speed, and F.linear is kept


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` as `weight @ x.T` where that is faster (fp32 on a CPU,
    2 to `MAX_ROWS` rows, plain tensors); None where `F.linear` should run."""
    if type(weight) not in (torch.Tensor, torch.nn.Parameter) or type(x) is not torch.Tensor:
        return None  # a tensor subclass (a quantized weight) keeps its own kernel
    if x.device.type != "cpu" or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return None
    num_rows = x.numel() // max(x.shape[-1], 1)
    if not 2 <= num_rows <= MAX_ROWS:
        return None
    flat = x.reshape(num_rows, x.shape[-1])  # [rows, in]
    out = torch.mm(weight, flat.t()).t().contiguous()  # [rows, out]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


class FewRowsLinear(TorchFunctionMode):
    """While entered (in this thread only), every `F.linear` takes `few_rows_linear`
    where it applies."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            out = few_rows_linear(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)
