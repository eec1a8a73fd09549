"""Quantized weights kept as stored: the modules that hold them (what a converted .gguf's
config says of them is read in `model/gguf_settings.py`; which module each layout makes:
`traits.LAYOUTS`, swapped in by `swap.py`).

A quantized weight is a uint8 parameter [rows, bytes per row] in its file's own block
layout, so the offloaders, slabs, copies and the disk tier move it as they move any
tensor: its stored bytes, never a float copy. Each forward de-quantizes it into a
temporary just before the product (`gguf_quants`: bit for bit the `gguf` package's
values), so a quantized model gives bitwise what its de-quantized float32 model gives.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from offload.errors import ConfigError, ModelError
from offload.quant.gguf_quants import EIGHT_BIT_GROUPS, FORMATS
from offload.quant.kernels import stored_op
from offload.quant.layouts import GROUP, inner_k_tiles, q4_scale_dtype
from offload.quant.packed_modules import method_of

ROW_ORDERS_KEY = "rotary_rows"  # quantization_config: weights in llama.cpp's row order
# vLLM's `quantization=` values: those read here, then those refused by name.
READ = ("gguf", "compressed-tensors", "gptq", "gptq_marlin", "awq", "awq_marlin", "fp8")
NOT_YET = ("bitsandbytes", "marlin", "modelopt", "torchao", "mxfp4", "gptq_bitblas", "awq_triton")


def check_quantization(value: object, name: str = "LLM(): quantization") -> str | None:
    """`quantization=` as vLLM takes it: None (as the checkpoint says) or a method name;
    `name` says where it was given, for the error."""
    if value is None or value in READ:
        return value  # type: ignore[return-value]
    if value in NOT_YET:
        raise ConfigError(f"{name}={value!r} is not supported (yet; read: {', '.join(READ)})")
    raise ConfigError(f"{name} must be None or one of {', '.join(READ)}; got {value!r}")


def stored_form(hf_config: Any) -> str | None:
    """What a model built from `hf_config` holds as stored ("GGUF Q4_1, Q8_0 as stored",
    "gptq as stored"), or None for a float model."""
    quantization = getattr(hf_config, "quantization_config", None)
    if not isinstance(quantization, dict):
        return None
    if quantization.get("quant_method") == "gguf":
        kinds = sorted(set((quantization.get("weight_types") or {}).values()))
        return f"GGUF {', '.join(kinds)} as stored"
    method = method_of(quantization)
    return f"{method} as stored" if method else None


def rows_in_hf_order(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's query/key rows (for its interleaved rotary layout) in transformers'
    order: within each of `heads` heads, its (even, odd) rows become (first half, second
    half). Rows move whole, so a block row's bytes move unchanged (transformers does the
    same on the floats). A new contiguous tensor."""
    return rows.unflatten(0, (heads, -1, 2)).transpose(1, 2).reshape(rows.shape)


class GGUFLinear(nn.Module):
    """`nn.Linear` with its weight in GGUF blocks; `weight` is uint8 [out, bytes per row].
    `heads` > 0: its rows are kept as llama.cpp orders them (the .gguf's own bytes, read in
    place) and are put in transformers' order at each product: the same floats, so the
    same bits, as rows reordered once."""

    holds_stored_weights = True  # (`sizes.compute_dtype` looks past them)
    linear_of_floats = True  # (its product is F.linear: `cpu_linear.kernels_for` counts it)

    def __init__(self, linear: nn.Linear, kind: str, heads: int = 0):
        super().__init__()
        self.in_features, self.out_features, self.kind = (
            linear.in_features,
            linear.out_features,
            kind,
        )
        if heads and linear.out_features % (2 * heads):
            raise ModelError(f"{linear.out_features} rows are not pairs of rows of {heads} heads")
        self.heads = heads
        row_bytes = _row_bytes(linear.in_features, kind, linear)
        self.weight = nn.Parameter(
            torch.empty(linear.out_features, row_bytes, dtype=torch.uint8, device="meta"),
            requires_grad=False,
        )
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = rows_in_hf_order(self.weight, self.heads) if self.heads else self.weight
        return stored_op("gguf", x, weight, self.kind, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


class Int4Linear(nn.Module):
    """`nn.Linear` with a 4-bit weight in torch's CPU int4 packing (`quant/layouts.py`):
    `weight` uint8 [out, in / 2], `scale_zero` bfloat16 [in / 32, out, 2]."""

    holds_stored_weights = True

    op = "int4"  # (`stored_op`'s name for the product)

    def __init__(self, linear: nn.Linear, kind: str):
        super().__init__()
        self.in_features, self.out_features, self.kind = _sizes(linear, kind)
        _groups(linear.in_features, linear)
        self.weight = _meta(*self._packed(linear.in_features, linear.out_features))
        shape = (linear.in_features // GROUP, linear.out_features, 2)
        self.scale_zero = _meta(shape, torch.bfloat16)
        self.bias = linear.bias

    @staticmethod
    def _packed(rows_in: int, rows_out: int) -> tuple[tuple[int, ...], torch.dtype]:
        return (rows_out, rows_in // 2), torch.uint8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = stored_op(self.op, x.reshape(-1, self.in_features), self.weight, self.scale_zero)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    extra_repr = GGUFLinear.extra_repr


class Q4Linear(nn.Module):
    """`nn.Linear` with a 4-bit weight in the q4 layout (`quant/layouts.py`): `weight` uint8
    [out / 16, in / 32, 256], `scales` and `offsets` [in / 32, out]."""

    holds_stored_weights = True

    def __init__(self, linear: nn.Linear, kind: str):
        super().__init__()
        self.in_features, self.out_features, self.kind = _sizes(linear, kind)
        groups = _groups(linear.in_features, linear)
        tiles = (linear.out_features + 15) // 16
        self.weight = _meta((tiles, groups, 256), torch.uint8)
        self.scales = _meta((groups, linear.out_features), q4_scale_dtype(kind))
        self.offsets = _meta((groups, linear.out_features), q4_scale_dtype(kind))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = stored_op("q4", rows, self.weight, self.scales, self.offsets)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    extra_repr = GGUFLinear.extra_repr


class Int4CudaLinear(Int4Linear):
    """`Int4Linear` in torch's GPU int4 packing (`quant/layouts.py`): `weight` int32
    [out / 8, in / (16 k), 32, k / 2] for k inner tiles."""

    op = "int4_cuda"

    @staticmethod
    def _packed(rows_in: int, rows_out: int) -> tuple[tuple[int, ...], torch.dtype]:
        tiles = inner_k_tiles(rows_in)
        return (rows_out // 8, rows_in // (16 * tiles), 32, tiles // 2), torch.int32


def _q8_parameters(module: nn.Module, kind: str, values: int, rows: int) -> None:
    """A q8 weight's parameters on `module` (`quant/layouts.py`): `weight` int8 [values / g,
    rows, g], `scales` [values / g, rows] (float16 where the file's are, else float32) and,
    for the types with a minimum, `offsets` like the scales (else None)."""
    group, has_offsets = EIGHT_BIT_GROUPS[kind]
    columns = _groups(values, module, group)
    scale_dtype = torch.float32 if kind.endswith("_K") else torch.float16
    module.weight = _meta((columns, rows, group), torch.int8)
    module.scales = _meta((columns, rows), scale_dtype)
    module.offsets = _meta((columns, rows), scale_dtype) if has_offsets else None


class Q8Linear(nn.Module):
    """`nn.Linear` with a weight that fits 8 bits (Q8_0, Q5_0, Q5_1, Q5_K, Q6_K) by block
    column: `weight`, `scales` and `offsets` as `_q8_parameters` makes them."""

    holds_stored_weights = True

    def __init__(self, linear: nn.Linear, kind: str = "Q8_0"):
        super().__init__()
        self.in_features, self.out_features, self.kind = _sizes(linear, kind)
        _q8_parameters(self, kind, linear.in_features, linear.out_features)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = stored_op(
            "q8", x.reshape(-1, self.in_features), self.weight, self.scales, self.offsets
        )
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    extra_repr = GGUFLinear.extra_repr


# Why an embedding keeps its compute dtype in a tuple, not as a `torch.dtype` attribute:
# a kept compiled step (`engine/step_cache.py`, torch 2.13's aot_compile) pickles its guards
# with every module attribute they do not read replaced by a placeholder, matched by
# identity; a dtype is a singleton, so every float32 tensor's dtype in the guards became
# the placeholder, and the step failed to load ("argument 'dtype' must be torch.dtype").
# Only the tuple is replaced.
class Q8Embedding(nn.Module):
    """`nn.Embedding` with its table by block column (as `Q8Linear`'s weight, so a tied
    head shares it): a lookup de-quantizes only the rows asked for, bit for bit."""

    holds_stored_weights = True

    def __init__(self, embedding: nn.Embedding, kind: str = "Q8_0"):
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.kind, self.padding_idx = kind, embedding.padding_idx
        _q8_parameters(self, kind, embedding.embedding_dim, embedding.num_embeddings)
        self._compute = (embedding.weight.dtype,)  # (a tuple: see above)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        values = stored_op("q8_rows", ids, self.weight, self.scales, self.offsets)
        return values.to(self._compute[0]).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind}"


def _sizes(linear: nn.Linear, kind: str) -> tuple[int, int, str]:
    return linear.in_features, linear.out_features, kind


def _groups(values: int, module: nn.Module, group: int = GROUP) -> int:
    if values % group:
        raise ModelError(
            f"{type(module).__name__} rows of {values} values are not whole groups of {group}"
        )
    return values // group


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)


class GGUFEmbedding(nn.Module):
    """`nn.Embedding` with its table in GGUF blocks: only the rows looked up are read."""

    holds_stored_weights = True

    def __init__(self, embedding: nn.Embedding, kind: str):
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.kind, self.padding_idx = kind, embedding.padding_idx
        row_bytes = _row_bytes(embedding.embedding_dim, kind, embedding)
        self.weight = nn.Parameter(
            torch.empty(embedding.num_embeddings, row_bytes, dtype=torch.uint8, device="meta"),
            requires_grad=False,
        )
        self._compute = (embedding.weight.dtype,)  # (a tuple: see above Q8Embedding)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        values = stored_op("gguf_rows", ids, self.weight, self.kind)
        return values.to(self._compute[0]).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind}"


def _row_bytes(values: int, kind: str, module: nn.Module) -> int:
    block = FORMATS[kind]
    if values % block.block_size:
        raise ModelError(
            f"{type(module).__name__} rows of {values} values are not whole {kind} blocks "
            f"of {block.block_size}"
        )
    return values // block.block_size * block.block_bytes
