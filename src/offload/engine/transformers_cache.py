"""The transformers side of the KV cache: a `StaticCache` whose full-attention layers
keep their keys and values in a `KVOffloader` (host memory), the probe of what those
layers really cache, and the cache keyword of a model's forward. Everything that knows
transformers' cache classes and their attributes is here."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable

import torch

from offload.engine.kv_cache import KVHostPool, KVOffloader
from offload.errors import ModelError
from offload.memory.copy_engine import CopyEngine, make_copy_engine
from offload.memory.kv_shape import KV_SLOTS, kv_shape_of

_logger = logging.getLogger("offload")


def probe_kv_dims(model) -> tuple[int, int, int] | None:
    """(heads, key dim, value dim) of what the model's full-attention layers cache, seen
    by running one token: some attentions cache other shapes than their config suggests
    (DeepSeek's latent attention caches compressed keys). None when there is no such
    layer; a ModelError when they differ from layer to layer."""
    from transformers import DynamicCache, StaticCache
    from transformers.cache_utils import StaticLayer

    layers = StaticCache(config=model.config, max_cache_len=1).layers
    held = getattr(model, "held_layers", None)  # (a pipeline stage runs its layers alone)
    full = [i for i, layer in enumerate(layers) if type(layer) is StaticLayer]
    full = [i for i in full if held is None or i in held]
    if not full:
        return None
    cache = DynamicCache(config=model.config)
    device = next(model.parameters()).device
    with torch.inference_mode():
        model(
            input_ids=torch.zeros((1, 1), dtype=torch.long, device=device),
            **cache_argument(model, cache),
            use_cache=True,
            logits_to_keep=1,
        )
    seen = set()
    for index in full:
        keys, values = cache.layers[index].keys, cache.layers[index].values
        if keys.shape[1] != values.shape[1]:
            raise ModelError("KV offload needs keys and values with as many heads")
        seen.add((keys.shape[1], keys.shape[-1], values.shape[-1]))
    if len(seen) != 1:
        raise ModelError(
            f"KV offload needs one cache shape for all attention layers, this model has {sorted(seen)}"
        )
    return seen.pop()


def static_cache(
    hf_config,
    batch: int,
    max_cache_len: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    offload: bool = False,
    num_slots: int = KV_SLOTS,
    disable_pin_memory: bool = False,
    copy_engine_factory: Callable[[torch.device], CopyEngine] = make_copy_engine,
    host_pool: KVHostPool | None = None,
    kv_dims: tuple[int, int, int] | None = None,
):
    """A transformers `StaticCache`; with `offload` (sized by `kv_dims`, see
    `probe_kv_dims`, or by the config), its full-attention layers keep their
    keys and values in host memory (`cache.kv_offloader`, a `KVOffloader`; from
    `host_pool` when given, to reuse it across calls), and only `num_slots` layers' worth
    of device memory is used. Other layer kinds (sliding windows, linear attention) are
    small and stay on the device."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    cache = StaticCache(config=hf_config, max_cache_len=max_cache_len)
    cache.kv_offloader = None
    indices = [i for i, layer in enumerate(cache.layers) if type(layer) is StaticLayer]
    if not offload:
        for index in indices:
            cache.layers[index] = _static_layers().StepStaticLayer(max_cache_len)
        return cache
    if not indices:
        _logger.warning(
            "KV offload: this model's attention layers all use sliding windows, whose caches "
            "are bounded by the window; the KV cache stays on the device"
        )
        return cache
    shape = kv_shape_of(hf_config, batch, max_cache_len, dtype, kv_dims)
    offloader = KVOffloader(
        len(indices),
        shape,
        device,
        num_slots=num_slots,
        disable_pin_memory=disable_pin_memory,
        copy_engine_factory=copy_engine_factory,
        host_pool=host_pool,
    )
    for position, index in enumerate(indices):
        cache.layers[index] = _offloaded_layer(max_cache_len, offloader, position)
    cache.kv_offloader = offloader
    return cache


def _offloaded_layer(max_cache_len: int, offloader: KVOffloader, position: int):
    layer = _static_layers().OffloadedStaticLayer(max_cache_len)
    layer.offloader, layer.offloader_id, layer.position = offloader, offloader.id, position
    shape = offloader.shape
    layer.dtype, layer.device = shape.dtype, offloader.device
    layer.batch_size = layer.max_batch_size = shape.batch
    layer.num_heads = shape.num_heads
    layer.k_head_dim = layer.head_dim = shape.k_head_dim
    layer.v_head_dim = shape.v_head_dim
    layer.keys, layer.values = offloader.views(position)
    if hasattr(layer, "cumulative_length"):
        layer.cumulative_length = layer.cumulative_length.to(offloader.device)
    layer.is_initialized = True
    return layer


def _static_layers():
    """The module of our static layer classes (it imports transformers: on first use, so
    that importing offload does not)."""
    from offload.engine import static_layers

    return static_layers


def cache_argument(model: torch.nn.Module, cache: object) -> dict[str, object]:
    """`cache` as the keyword the model's forward takes: `cache` from transformers 5.23
    (where `past_key_values` is deprecated, with a warning at every call), else
    `past_key_values`."""
    return {_cache_keyword(type(model)): cache}


@functools.cache
def _cache_keyword(model_type: type) -> str:
    parameters = inspect.signature(model_type.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"
