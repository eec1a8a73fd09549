"""Quantized weights kept as stored: the modules that hold them and the settings that
name them.

A quantized weight is a uint8 parameter [rows, bytes per row] in its file's own block
layout, so the offloaders, slabs, copies and the disk tier move it as they move any
tensor: its stored bytes, never a float copy. Each forward de-quantizes it into a
temporary just before the product (`gguf_quants`: bit for bit the `gguf` package's
values), so a quantized model gives bitwise what its de-quantized float32 model gives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from offload.errors import ConfigError, ModelError
from offload.model.gguf_quants import FORMATS, dequantize

# vLLM's `quantization=` values: those read here, then those refused by name.
READ = ("gguf",)
NOT_YET = (
    "awq", "awq_marlin", "gptq", "gptq_marlin", "compressed-tensors", "fp8", "bitsandbytes",
    "marlin", "modelopt", "torchao", "mxfp4",
)  # fmt: skip


def check_quantization(value: object) -> str | None:
    """`quantization=` as vLLM takes it: None (as the checkpoint says) or a method name."""
    if value is None or value in READ:
        return value  # type: ignore[return-value]
    if value in NOT_YET:
        raise ConfigError(
            f"LLM(): quantization={value!r} is not supported (yet; read: {', '.join(READ)})"
        )
    raise ConfigError(
        f"LLM(): quantization must be None or one of {', '.join(READ)}; got {value!r}"
    )


def weight_types(settings: Mapping[str, Any], where: object) -> dict[str, str]:
    """The GGUF type of each quantized weight named by config.json (ModelError if any is
    not one that is read)."""
    types = settings.get("weight_types")
    if not isinstance(types, dict) or not all(isinstance(k, str) for k in types):
        raise ModelError(f"{where}: quantization_config of method gguf needs weight_types")
    for name, kind in types.items():
        if kind not in FORMATS:
            raise ModelError(
                f"{where}: {name} is of GGUF type {kind!r}; read: {', '.join(FORMATS)}"
            )
    return dict(types)


class GGUFLinear(nn.Module):
    """`nn.Linear` with its weight in GGUF blocks; `weight` is uint8 [out, bytes per row]."""

    def __init__(self, linear: nn.Linear, kind: str):
        super().__init__()
        self.in_features, self.out_features, self.kind = (
            linear.in_features,
            linear.out_features,
            kind,
        )
        row_bytes = _row_bytes(linear.in_features, kind, linear)
        self.weight = nn.Parameter(
            torch.empty(linear.out_features, row_bytes, dtype=torch.uint8, device="meta"),
            requires_grad=False,
        )
        self.bias = linear.bias
        self.compute_dtype = linear.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = dequantize(self.weight, self.kind).to(self.compute_dtype)
        return F.linear(x, weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


class GGUFEmbedding(nn.Module):
    """`nn.Embedding` with its table in GGUF blocks: only the rows looked up are read."""

    def __init__(self, embedding: nn.Embedding, kind: str):
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.kind, self.padding_idx = kind, embedding.padding_idx
        row_bytes = _row_bytes(embedding.embedding_dim, kind, embedding)
        self.weight = nn.Parameter(
            torch.empty(embedding.num_embeddings, row_bytes, dtype=torch.uint8, device="meta"),
            requires_grad=False,
        )
        self.compute_dtype = embedding.weight.dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize(self.weight[ids], self.kind).to(self.compute_dtype)

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


def swap_in_quantized(model: nn.Module, types: Mapping[str, str], where: object) -> None:
    """Replace each module whose weight `types` names by its quantized form, keeping tied
    weights tied (Llama's lm_head reads the embedding's blocks)."""
    owners = {name.removesuffix(".weight"): kind for name, kind in types.items()}
    tied = _tied_to_embedding(model)
    swapped: dict[str, nn.Module] = {}
    for name, module in list(model.named_modules()):
        if name not in owners:
            continue
        if isinstance(module, nn.Linear):
            new: nn.Module = GGUFLinear(module, owners[name])
        elif isinstance(module, nn.Embedding):
            new = GGUFEmbedding(module, owners[name])
        else:
            raise ModelError(
                f"{where}: {name} is a {type(module).__name__}; quantized: Linear, Embedding"
            )
        model.set_submodule(name, new)
        swapped[name] = new
    missing = set(owners) - set(swapped)
    if missing:
        raise ModelError(
            f"{where}: weight_types names {sorted(missing)[:3]}, which the model has not"
        )
    if tied is not None:
        embedding_name, head_name = tied
        embedding, head = model.get_submodule(embedding_name), model.get_submodule(head_name)
        if isinstance(embedding, GGUFEmbedding):
            if not isinstance(head, GGUFLinear):  # (the file has no head of its own)
                head = GGUFLinear(head, embedding.kind)
                model.set_submodule(head_name, head)
            head.weight = embedding.weight


def _tied_to_embedding(model: nn.Module) -> tuple[str, str] | None:
    """(embedding's name, output head's name) when the head's weight is the embedding's."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embedding is None or head is None or head.weight is not embedding.weight:
        return None
    names = {id(module): name for name, module in model.named_modules()}
    return names[id(embedding)], names[id(head)]
