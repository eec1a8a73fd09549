"""A prompt's attention on a CPU with each position's bits its own: the same whether the
prompt is prefilled whole, in chunks, after a cached prefix, or beside other tokens; and
a decode step's, the same kernel, so that a decoded token's keys and values have the bits
its prefill would give them (prefix caching then reuses an answer's columns too).

ATen's CPU attention groups the queries into blocks by how many there are and multiplies
each block by the keys in one product, so a position's sums round with the positions
beside it: prefilled after a held prefix of 32 tokens, the default model's first logprobs
moved by 0.05 nat from the whole prompt's (measured). `row_dot.c`'s `rowdot_attention`
computes each query alone over the columns its mask lets it read, in one fixed order
(`quant/row_attention.c`). A prompt's forwards run it through `PromptKernels`, as they
run their linears through the row-invariant products at any row count.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from offload.engine import cpu_linear
from offload.engine.cpu_linear import FewRowsLinear, kernels_for
from offload.quant import row_dot

TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # (row_dot.c's enum)
MAX_DIM = 256  # a head's width, at most (the kernel's sums live on the stack)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    known: dict | None = None,
) -> torch.Tensor | None:
    """`F.scaled_dot_product_attention` of query [batch, heads, tokens, dim] over key and
    value [batch, kv heads, columns, dim], each query over the columns its mask lets it
    read; None where the kernel does not take the call (not a CPU, another dtype, dropout,
    a mask that is not one run of columns per query, a head wider than `MAX_DIM`): then
    ATen's runs. `known`: the last mask's columns, kept there (a forward's layers share
    one mask: read once)."""
    lib = row_dot.library()
    if lib is None or dropout_p or not _takes(query, key, value):
        return None
    batch, heads, tokens, dim = query.shape
    kv_heads, width = key.shape[1], key.shape[2]
    if heads % kv_heads or (heads != kv_heads and not enable_gqa):
        return None
    if is_causal and attn_mask is None:  # (SDPA's: query t reads columns 0..t)
        hi = torch.arange(1, tokens + 1).clamp(max=width).expand(batch, 1, tokens)
        bounds = torch.zeros(batch, 1, tokens, dtype=torch.int64), hi.contiguous()
    else:
        bounds = _known_bounds(attn_mask, (batch, heads, tokens, width), known)
    if bounds is None:
        return None
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    out = torch.empty(batch, heads, tokens, dim)
    q = query.to(torch.float32).contiguous()
    lo, hi = (b.contiguous() for b in bounds)
    failed = lib.rowdot_attention(
        q.data_ptr(), batch, heads, tokens, dim, key.data_ptr(), value.data_ptr(),
        TYPES[value.dtype], *key.stride()[:3], *value.stride()[:3], heads // kv_heads,
        lo.data_ptr(), hi.data_ptr(), lo.shape[1], scale, out.data_ptr(),
        torch.get_num_threads(), None,
    )  # fmt: skip
    if failed:
        raise MemoryError(f"no memory for the attention scores of {tokens} tokens")
    return out.to(query.dtype)


def _takes(query, key, value) -> bool:
    tensors = (query, key, value)
    if any(type(t) is not torch.Tensor or t.device.type != "cpu" or t.dim() != 4 for t in tensors):
        return False
    if key.dtype not in TYPES or value.dtype != key.dtype or query.dtype not in TYPES:
        return False
    if key.shape != value.shape or key.shape[0] != query.shape[0]:
        return False
    dim = query.shape[-1]
    return key.shape[-1] == dim <= MAX_DIM and key.stride(-1) == value.stride(-1) == 1


def _known_bounds(mask, shape, known: dict | None):
    """`_bounds` of `mask`, from `known` where it holds this very mask (the same tensor,
    unchanged since: an inference tensor keeps no count of its changes, but `known` lives
    for one forward, which changes no mask, and holds the mask, so its id is not reused)
    for the same shape; kept there (a compiled step passes its layers two or three views
    of one mask: each read once)."""
    if known is None or mask is None:
        return _bounds(mask, *shape)
    key = (id(mask), None if mask.is_inference() else mask._version, shape)
    if key not in known:
        known[key] = (mask, _bounds(mask, *shape))
    return known[key][1]


def _bounds(mask, batch, heads, tokens, width):
    """Each query's columns [lo, hi) as two int64 tensors [batch, 1 or heads, tokens]
    (every column where `mask` is None); None where a query's readable columns are not
    one run, or a float mask holds values other than 0 and "never" (a bias). The mask is
    read `_PIECE` queries at a time (its copies stay small beside a long prompt's)."""
    if mask is None:
        lo = torch.zeros(batch, 1, tokens, dtype=torch.int64)
        return lo, torch.full_like(lo, width)
    if mask.dim() > 4 or mask.shape[-1] != width:
        return None
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    if mask.shape[0] not in (1, batch) or mask.shape[1] not in (1, heads):
        return None
    if mask.shape[2] not in (1, tokens):
        return None
    mask = mask.expand(batch, mask.shape[1], tokens, width)
    lo = torch.zeros(batch, mask.shape[1], tokens, dtype=torch.int64)
    hi = torch.zeros_like(lo)
    for start in range(0, tokens, _PIECE):
        part = mask[:, :, start : start + _PIECE]
        if part.dtype != torch.bool:
            never = part <= torch.finfo(part.dtype).min / 2
            if not ((part == 0) | never).all():
                return None
            part = ~never
        count = part.sum(-1)
        first = part.to(torch.uint8).argmax(-1)
        last = width - 1 - part.flip(-1).to(torch.uint8).argmax(-1)
        some = count > 0
        if not (~some | (count == last - first + 1)).all():
            return None
        lo[:, :, start : start + _PIECE] = torch.where(some, first, 0)
        hi[:, :, start : start + _PIECE] = torch.where(some, last + 1, 0)
    return lo, hi


_PIECE = 256  # queries whose mask rows are read at once


class PromptKernels(FewRowsLinear):
    """A prompt's forward on a CPU: `FewRowsLinear`'s products (the row-invariant ones at
    any row count), and every `F.scaled_dot_product_attention` through `attention` above;
    so a position's bits do not depend on how its prompt was cut."""

    def __init__(self):
        super().__init__()
        self.known: dict = {}  # (`attention`'s: the last mask's columns)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            out = attention(*args, **(kwargs or {}), known=self.known)
            if out is not None:
                return out
        return super().__torch_function__(func, types, args, kwargs)


@dataclass
class Forward:
    """One decode step's (or mixed forward's) attention calls: the mask's columns read
    once for every layer (`known`: an op compiled into a step holds no state of its own),
    and whether every call took the kernel (`exact`: its new columns then have the bits a
    prefill gives them)."""

    known: dict = field(default_factory=dict)
    calls: int = 0
    fell_back: bool = False

    @property
    def exact(self) -> bool:
        return self.calls > 0 and not self.fell_back


_current = threading.local()  # (a server's engine thread and a caller's `generate` apart)


@contextmanager
def one_forward() -> Iterator[Forward]:
    """The `Forward` that `step_attention` calls record into while entered."""
    record, before = Forward(), getattr(_current, "forward", None)
    _current.forward = record
    try:
        yield record
    finally:
        _current.forward = before


def forward_known() -> dict | None:
    """The masks' columns read in the current `one_forward` (None outside one): a packed
    prefill's chunks each have a mask of their own, the same tensor in every layer."""
    record = getattr(_current, "forward", None)
    return None if record is None else record.known


def step_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
    """`attention` of a decode step's call (`F.scaled_dot_product_attention`'s arguments),
    recorded in the current `one_forward`; None where the kernel does not take it (then
    ATen's runs, and the forward is not exact)."""
    known = forward_known()
    out = attention(query, key, value, attn_mask, dropout_p, is_causal, **kwargs, known=known)
    record_call(exact=out is not None)
    return out


def record_call(exact: bool) -> None:
    """An attention call of the current `one_forward` (if any): `exact`, the kernel's."""
    record = getattr(_current, "forward", None)
    if record is not None:
        record.calls += 1
        record.fell_back |= not exact


def prompt_kernels(model: torch.nn.Module, device: torch.device):
    """The context a prefill of `model` runs in: on a CPU where the row-invariant products
    are built, `PromptKernels`; else `kernels_for`'s."""
    if device.type != "cpu" or not cpu_linear.row_invariant(model):
        return kernels_for(model, device)
    return PromptKernels()
