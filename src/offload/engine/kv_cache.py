"""The static KV cache for `LLM`: in device memory, or in host memory with a ring of
device slots that each layer's keys and values are brought into just before use.

Why not transformers' own `StaticCache(offloading=True)`: it copies every layer's whole
cache (all `max_cache_len` positions) to the device and back to the host at every token,
into new tensors each time (no CUDA graphs), and it needs CUDA. Here the host keeps the
cache; a layer's slot is refilled with only the positions written so far, and only the
new positions are written back. Layout, per layer: `[max_cache_len, row]`, a row being
one position's keys then values for the whole batch, so that "the first L positions"
is one contiguous byte range on both sides (one copy).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from offload.errors import ConfigError, ModelError
from offload.memory.copy_engine import CopyEngine, make_copy_engine
from offload.memory.host import (
    HostSlab,
    TensorSpec,
    device_view,
    meminfo_bytes,
    should_pin_memory,
)
from offload.memory.slots import SlotTable, slot_of

_GIB = 1024**3
_logger = logging.getLogger("offload")
KV_SLOTS = 2  # device slots of the KV ring: the next layer arrives while one computes


@dataclass(frozen=True)
class KVShape:
    """One layer's keys and values: [batch, num_heads, max_cache_len, head_dim]."""

    batch: int
    num_heads: int
    max_cache_len: int
    k_head_dim: int
    v_head_dim: int
    dtype: torch.dtype

    @property
    def row_elements(self) -> int:
        """Elements of one position (keys, then values, of every sequence and head)."""
        return self.batch * self.num_heads * (self.k_head_dim + self.v_head_dim)

    @property
    def row_bytes(self) -> int:
        return self.row_elements * self.dtype.itemsize

    @property
    def layer_bytes(self) -> int:
        return self.max_cache_len * self.row_bytes

    def split(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values as transformers wants them, [batch, heads, len, dim], viewed
        over `rows` ([max_cache_len, row_elements]): no copy, fixed addresses."""
        keys_width = self.batch * self.num_heads * self.k_head_dim
        keys = rows[:, :keys_width].unflatten(1, (self.batch, self.num_heads, self.k_head_dim))
        values = rows[:, keys_width:].unflatten(1, (self.batch, self.num_heads, self.v_head_dim))
        return keys.permute(1, 2, 0, 3), values.permute(1, 2, 0, 3)


def kv_shape_of(
    hf_config,
    batch: int,
    max_cache_len: int,
    dtype: torch.dtype,
    dims: tuple[int, int, int] | None = None,
) -> KVShape:
    """A cache layer's shape: from `dims` (heads, key dim, value dim, as `probe_kv_dims`
    measures them) or else from the config's usual fields."""
    if dims is None:
        heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
        head_dim = (
            getattr(hf_config, "head_dim", None)
            or hf_config.hidden_size // hf_config.num_attention_heads
        )
        dims = (heads, head_dim, head_dim)
    heads, k_head_dim, v_head_dim = dims
    return KVShape(batch, heads, max_cache_len, k_head_dim, v_head_dim, dtype)


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


def available_ram_bytes() -> int:
    """Host memory that can be had now without swapping (the kernel's MemAvailable)."""
    available = meminfo_bytes("MemAvailable")
    if available is not None:
        return available
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_swap_space(swap_space: float) -> int:
    """`swap_space` GiB as bytes, refused (before anything is allocated) when negative
    or larger than the RAM available now."""
    if isinstance(swap_space, bool) or not isinstance(swap_space, int | float):
        raise ConfigError(f"swap_space must be a number of GiB, got {swap_space!r}")
    available = available_ram_bytes()
    if not 0 <= swap_space * _GIB <= available:
        raise ConfigError(
            f"swap_space={swap_space:g} GiB is not possible: it must be between 0 and the "
            f"{available / _GIB:.2f} GiB of RAM available now"
        )
    return int(swap_space * _GIB)


def check_host_room(swap_space_bytes: int, offloaded_weight_bytes: int) -> None:
    """Refuse, before loading, a `swap_space` that fits in RAM only without the weights
    that offloading will put there too."""
    available = available_ram_bytes()
    if swap_space_bytes and swap_space_bytes + offloaded_weight_bytes > available:
        raise ConfigError(
            f"swap_space={swap_space_bytes / _GIB:g} GiB plus the "
            f"{offloaded_weight_bytes / _GIB:.2f} GiB of offloaded weights is more than the "
            f"{available / _GIB:.2f} GiB of RAM available now; lower swap_space or offload less"
        )


def check_host_kv(
    shape: KVShape, num_layers: int, swap_space_bytes: int, held_bytes: int = 0
) -> None:
    """Refuse, before allocating, a host KV cache larger than `swap_space` (when set) or
    than the RAM available (counting the `held_bytes` a `KVHostPool` would give back)."""
    need = shape.layer_bytes * num_layers
    limit = swap_space_bytes or available_ram_bytes() + held_bytes
    if need > limit:
        what = "swap_space" if swap_space_bytes else "the RAM available"
        raise ConfigError(
            f"the KV cache for {shape.batch} sequence(s) of {shape.max_cache_len} positions "
            f"needs {_size(need)} of host memory, more than {what} ({_size(limit)}); "
            "lower max_tokens, max_model_len or the batch, or raise swap_space"
        )


def _size(num_bytes: int) -> str:
    return f"{num_bytes / _GIB:.2f} GiB" if num_bytes >= _GIB else f"{num_bytes / 2**20:.1f} MiB"


class KVHostPool:
    """Host memory for offloaded KV caches, kept from one call to the next: one buffer
    per cache layer, allocated (and pinned, on a GPU) only when a call needs more than
    the pool holds, and reused otherwise, so repeated `generate` calls pay for
    allocation, page faults and pinning once."""

    def __init__(self, device: torch.device, *, disable_pin_memory: bool = False):
        device = torch.device(device)
        self._pin_for = device if should_pin_memory(device, disable_pin_memory) else None
        self._slabs: list[HostSlab] = []

    @property
    def num_bytes(self) -> int:
        return sum(slab.num_bytes for slab in self._slabs)

    def take(self, num_layers: int, layer_bytes: int) -> list[HostSlab]:
        """`num_layers` buffers of at least `layer_bytes` each (old contents are left:
        a cache reads only the positions it has written)."""
        held = max((slab.num_bytes for slab in self._slabs), default=0)
        if len(self._slabs) < num_layers or held < layer_bytes:
            size = max(held, layer_bytes)
            count = max(len(self._slabs), num_layers)
            self._slabs = []  # the old buffers are freed before the new ones are made
            spec = TensorSpec((size,), torch.uint8)
            self._slabs = [HostSlab([spec], pin_for=self._pin_for) for _ in range(count)]
        return self._slabs[:num_layers]


class KVOffloader:
    """Host-resident keys and values of `num_layers` cache layers, a ring of `num_slots`
    device slots, and the schedule that fills them.

    Layers are numbered in the order their attention runs. Layer p always uses slot
    p % num_slots, so its keys and values are permanent views of that slot (fixed
    addresses, as a static cache needs). When layer p's `update` comes, the layer that
    ran before it is done reading its slot, so that slot is refilled (copy engine, off
    the compute path) with its next occupant: with two slots, the next layer's K/V
    arrive while this layer computes. The slot ownership table is the weight prefetch
    backend's, so skipped or repeated layers are loaded on demand, never read stale.
    """

    def __init__(
        self,
        num_layers: int,
        shape: KVShape,
        device: torch.device,
        *,
        num_slots: int = 2,
        disable_pin_memory: bool = False,
        copy_engine_factory: Callable[[torch.device], CopyEngine] = make_copy_engine,
        host_pool: KVHostPool | None = None,
    ):
        if num_layers < 1 or num_slots < 1:
            raise ConfigError(f"KV offload needs layers and slots, got {num_layers}, {num_slots}")
        self.shape = shape
        self.device = torch.device(device)
        spec = TensorSpec((shape.max_cache_len, shape.row_elements), shape.dtype)
        if host_pool is None:
            host_pool = KVHostPool(self.device, disable_pin_memory=disable_pin_memory)
        self._host = host_pool.take(num_layers, spec.num_bytes)
        # [max_len, row] each, over the first bytes of the layer's host buffer
        self.host_rows = [spec.view_of(slab.buffer[: spec.num_bytes]) for slab in self._host]
        # Kernels write new positions straight into host memory (zero-copy) on CUDA, so
        # the write-back needs no host-side position and can be captured in a graph.
        self._host_writable = [
            self._writable(rows, slab)
            for rows, slab in zip(self.host_rows, self._host, strict=True)
        ]
        self._table = SlotTable(num_layers, num_slots)
        self.slot_rows = [  # [max_len, row] each, on the device
            torch.zeros(spec.shape, dtype=shape.dtype, device=self.device)
            for _ in range(self._table.slots)
        ]
        self._tickets: list[object | None] = [None] * self._table.slots
        self._engine = copy_engine_factory(self.device)
        self._closed = False
        self.lengths = [0] * num_layers  # positions written so far, per layer
        self._last: int | None = None  # the layer that updated last (its slot is in use)
        self.capture_rows: int | None = None  # rows a CUDA graph copies (None: all)
        self.bytes_written_back = 0

    def _writable(self, rows: torch.Tensor, slab: HostSlab) -> torch.Tensor:
        if self.device.type == "cuda" and slab.is_pinned:
            return device_view(rows, self.device)
        return rows

    # -- what a cache layer sees ----------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self._host)

    @property
    def num_slots(self) -> int:
        return self._table.slots

    @property
    def host_bytes(self) -> int:
        return self.shape.layer_bytes * self.num_layers

    @property
    def device_bytes(self) -> int:
        return sum(rows.numel() * rows.element_size() for rows in self.slot_rows)

    def views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The permanent keys/values views ([batch, heads, len, dim]) of `layer`."""
        return self.shape.split(self.slot_rows[slot_of(layer, self.num_slots)])

    def before_update(self, layer: int) -> None:
        """Refill the slot the previous layer used, then make sure `layer`'s slot holds
        its keys and values before they are written and read."""
        if self._last is not None:
            self._refill_after(self._last)
        slot = slot_of(layer, self.num_slots)
        if self._table.needs_load(layer):
            # Its slot holds another layer (first forward, or a layer ran out of order).
            self._load(layer, slot)
        if self._tickets[slot] is not None:
            # Compute waits until the copy into this slot has landed.
            self._engine.wait(self._tickets[slot])
            self._tickets[slot] = None

    def after_update(self, layer: int, positions: torch.Tensor, count: int) -> None:
        """`count` new positions (`positions`, on the device) were written into the
        slot: write the same rows back to the host copy."""
        self._write_back(layer, positions, count)
        self.lengths[layer] += count
        self.bytes_written_back += count * self.shape.row_bytes
        self._last = layer

    def _write_back(self, layer: int, positions: torch.Tensor, count: int) -> None:
        rows = self.slot_rows[slot_of(layer, self.num_slots)]
        host = self._host_writable[layer]
        if host.device.type == "cuda":
            # A kernel writes the rows through the zero-copy view: the positions stay on the
            # device, so a CUDA graph replays it for whatever step it is.
            host.index_copy_(0, positions, rows.index_select(0, positions))
        else:
            # Host memory (the CPU, or pinning disabled): the rows were appended after the
            # `lengths[layer]` written so far; one slice copy is cheapest.
            start = self.lengths[layer]
            host[start : start + count].copy_(rows[start : start + count])

    def _refill_after(self, layer: int) -> None:
        following = self._table.next_load(layer)
        if following is None:
            return
        # The copy waits until compute issued so far (the layer that read this slot) is done.
        self._load(
            following, slot_of(following, self.num_slots), after=self._engine.mark_released()
        )

    def _load(self, layer: int, slot: int, after: object = None) -> None:
        """Bring `layer`'s positions into `slot`; the table calls the slot unknown until
        the copy is queued and its ticket kept (an interrupt in between: loaded again)."""
        self._table.start_load(layer)
        count = self._copy_rows(layer)
        ticket = None  # nothing written yet: nothing to bring
        if count:
            num_bytes = count * self.shape.row_bytes
            src = self._host[layer].buffer[:num_bytes]
            dst = self.slot_rows[slot].view(-1).view(torch.uint8)[:num_bytes]
            ticket = self._engine.copy(dst, src, after=after)
        self._tickets[slot] = ticket
        self._table.finish_load(layer)

    def _copy_rows(self, layer: int) -> int:
        """Positions to bring in: those written so far, or all of them inside a CUDA
        graph capture (a replay must copy whatever has been written by then)."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return self.capture_rows or self.shape.max_cache_len
        return self.lengths[layer]

    def synchronize(self) -> None:
        """Compute waits for every copy issued so far (inside a capture: joins the copy
        stream into the graph)."""
        self._engine.synchronize()

    def close(self) -> None:
        """Wait for every copy in flight, so the slots and host memory can be freed."""
        if self._closed:
            return
        self._closed = True
        self._engine.synchronize()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._engine.close()  # its thread ends now, not when the cache is collected

    def stats(self) -> dict[str, float | int]:
        stats = self._engine.collect_stats().as_dict()
        stats["bytes_written_back"] = self.bytes_written_back
        stats["host_bytes"] = self.host_bytes
        stats["device_bytes"] = self.device_bytes
        return stats


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

        def get_seq_length(self) -> int:
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
