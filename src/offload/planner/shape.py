"""What the planner needs to know of a model, read from it built on the meta device (no
weights): its layers' bytes, its experts, its KV cache and activations, and a digest of
its shape that measurements are cached under."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from offload.offloader.layers import find_layer_stacks, find_layers
from offload.offloader.selection import matches_segments
from offload.planner.fit import activation_bytes, kv_cache_bytes
from offload.quant.quantized import stored_form
from offload.sizes import compute_dtype, parameter_bytes

EXPERTS = "experts"  # the name segment of a mixture-of-experts layer's expert weights
# Config keys that name where a config came from, not the model's shape.
_NOT_SHAPE = ("_name_or_path", "transformers_version", "architectures", "auto_map")
# Config fields that hold a mixture-of-experts layer's expert count, by model family.
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class ModelShape:
    """A model's sizes in bytes. `layer_bytes`: each layer of its stack; `expert_bytes`:
    each layer's expert weights (0 for a dense layer); `kv_bytes_per_position`: one
    position of one sequence, all layers; `activation_bytes`: a prefill of the context."""

    weight_bytes: int
    layer_bytes: tuple[int, ...]
    expert_bytes: tuple[int, ...]
    kv_bytes_per_position: int
    activation_bytes: int
    num_experts: int
    experts_per_token: int
    dtype: torch.dtype
    stack_name: str
    timed_layer: int  # the layer whose compute stands for all (the most common size)
    digest: str
    # Quantized weights held as stored ("GGUF Q4_1, Q8_0 as stored"); None: all in `dtype`.
    stored: str | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)

    @property
    def outside_bytes(self) -> int:
        """Weights outside the layer stack (embeddings, final norm, lm_head): resident."""
        return self.weight_bytes - sum(self.layer_bytes)

    def kv_bytes(self, batch: int, context_len: int) -> int:
        return self.kv_bytes_per_position * batch * context_len


def shape_of(model: nn.Module, context_len: int) -> ModelShape:
    """The shape of `model` (built on the meta device) for decoding at `context_len`."""
    dtype = compute_dtype(model)
    layers = find_layers(model)
    layer_bytes = tuple(parameter_bytes(layer) for layer in layers)
    experts = tuple(
        sum(p.numel() * p.element_size() for n, p in layer.named_parameters() if _expert(n))
        for layer in layers
    )
    common = Counter(layer_bytes).most_common(1)[0][0]
    num_experts, per_token = expert_counts(model.config)
    return ModelShape(
        weight_bytes=parameter_bytes(model),
        layer_bytes=layer_bytes,
        expert_bytes=experts if num_experts else (0,) * len(layers),
        kv_bytes_per_position=kv_cache_bytes(model.config, 1, dtype),
        activation_bytes=activation_bytes(model.config, context_len, dtype),
        num_experts=num_experts,
        experts_per_token=per_token,
        dtype=dtype,
        stack_name=find_layer_stacks(model)[0][0],
        timed_layer=layer_bytes.index(common),
        digest=shape_digest(model.config, dtype),
        stored=stored_form(model.config),
    )


def _expert(name: str) -> bool:
    return matches_segments(name, (EXPERTS,))


def expert_counts(hf_config) -> tuple[int, int]:
    """(experts per layer, experts each token is routed to); (0, 0) for a dense model."""
    count = next(
        (getattr(hf_config, f, None) for f in _EXPERT_COUNTS if getattr(hf_config, f, None)), 0
    )
    per_token = getattr(hf_config, "num_experts_per_tok", None) or 0
    if not isinstance(count, int) or not isinstance(per_token, int) or not per_token:
        return 0, 0
    return count, per_token


def shape_digest(hf_config, dtype: torch.dtype) -> str:
    """A digest of the config's shape fields and the dtype (not of where it came from)."""
    settings = {k: v for k, v in hf_config.to_dict().items() if k not in _NOT_SHAPE}
    settings["dtype"] = str(dtype)
    text = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
