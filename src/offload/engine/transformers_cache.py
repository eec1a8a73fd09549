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

from offload.engine.kv_cache import KV_SLOTS, KVHostPool, KVOffloader
from offload.engine.kv_shape import kv_shape_of
from offload.errors import ModelError
from offload.memory.copy_engine import CopyEngine, make_copy_engine

_logger = logging.getLogger("offload")


def probe_kv_dims(model) -> tuple[int, int, int] | None:
    """(heads, key dim, value dim) of what the model's full-attention layers cache, seen
    by running one token: some attentions cache other shapes than their config suggests
    (DeepSeek's latent attention caches compressed keys). None when there is no such
    layer; a ModelError when they differ from layer to layer."""
    from transformers import DynamicCache, StaticCache
    from transformers.cache_utils import StaticLayer

    layers = StaticCache(config=model.config, max_cache_len=1).layers
    full = [i for i, layer in enumerate(layers) if type(layer) is StaticLayer]
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

    cache = StaticCache(config=hf_config, max_cache_len=max_cache_len)
    cache.kv_offloader = None
    if not offload:
        return cache
    from transformers.cache_utils import StaticLayer

    indices = [i for i, layer in enumerate(cache.layers) if type(layer) is StaticLayer]
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
    layer = _layer_class()(max_cache_len)
    layer.offloader, layer.position = offloader, position
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


@functools.cache
def _layer_class() -> type:
    """Made on first use, so that importing offload does not import transformers."""
    from transformers.cache_utils import StaticLayer

    class OffloadedStaticLayer(StaticLayer):
        """A `StaticLayer` whose keys and values are views of a device slot that a
        `KVOffloader` fills from host memory before each update."""

        offloader: KVOffloader
        position: int

        def lazy_initialization(self, *args, **kwargs) -> None:
            return None  # allocated up front, by the offloader

        def update(self, key_states, value_states, *args, **kwargs):
            count = key_states.shape[-2]
            cache_kwargs = kwargs.get("cache_kwargs", args[0] if args else None)
            positions = (
                cache_kwargs.get("cache_position") if isinstance(cache_kwargs, dict) else None
            )
            if positions is None:  # transformers >= 5.17 counts positions itself
                start = getattr(self, "cumulative_length", self.offloader.lengths[self.position])
                positions = torch.arange(count, device=self.device) + start
            if hasattr(self, "cumulative_length"):
                self.cumulative_length.add_(count)
            self.offloader.before_update(self.position)
            self.keys.index_copy_(2, positions, key_states)
            self.values.index_copy_(2, positions, value_states)
            self.offloader.after_update(self.position, positions, count)
            return self.keys, self.values

        def get_seq_length(self) -> int | torch.Tensor:
            # As StaticLayer: the device counter where there is one. The mask's query
            # offset is read from here, and a Python int would be frozen into a CUDA graph
            # at its capture (every replay then masked as the captured step).
            counter = getattr(self, "cumulative_length", None)
            if isinstance(counter, torch.Tensor):
                return counter
            return self.offloader.lengths[self.position]

    return OffloadedStaticLayer


def cache_argument(model: torch.nn.Module, cache: object) -> dict[str, object]:
    """`cache` as the keyword the model's forward takes: `cache` from transformers 5.23
    (where `past_key_values` is deprecated, with a warning at every call), else
    `past_key_values`."""
    return {_cache_keyword(type(model)): cache}


@functools.cache
def _cache_keyword(model_type: type) -> str:
    parameters = inspect.signature(model_type.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"
