"""The KV cache in host memory: each layer's keys and values live on the host, and a
ring of device slots receives them just before the layer's attention runs. Pure torch;
`transformers_cache.py` plugs it into transformers' `StaticCache`.

Why not transformers' own `StaticCache(offloading=True)`: it copies every layer's whole
cache (all `max_cache_len` positions) to the device and back to the host at every token,
into new tensors each time (no CUDA graphs), and it needs CUDA. Here the host keeps the
cache; a layer's slot is refilled with only the positions written so far, and only the
new positions are written back. Layout, per layer: `[max_cache_len, row]`, a row being
one position's keys then values for the whole batch, so that "the first L positions"
is one contiguous byte range on both sides (one copy).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from offload.errors import ConfigError
from offload.memory.copy_engine import CopyEngine, CopyStats, make_copy_engine
from offload.memory.host import HostSlab, TensorSpec, device_view, should_pin_memory
from offload.memory.kv_shape import KVShape
from offload.memory.slots import SlotTable, slot_of
from offload.offloader import ops


@dataclass(frozen=True)
class KVStats:
    """A KV offloader's figures at one moment."""

    copies: CopyStats = field(default_factory=CopyStats)  # host to device
    bytes_written_back: int = 0  # device to host
    host_bytes: int = 0
    device_bytes: int = 0

    @property
    def bytes_copied(self) -> int:
        return self.copies.bytes_copied


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
        self._pid = os.getpid()  # (its copy thread's process: a fork's close waits for none)
        self.lengths = [0] * num_layers  # positions written so far, per layer
        self._last: int | None = None  # the layer that updated last (its slot is in use)
        self.capture_rows: int | None = None  # rows a CUDA graph copies (None: all)
        self.bytes_written_back = 0
        self.id = ops.register(self)  # what a compiled step's cache update finds it by

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

    def __reduce__(self):
        # A compiled step kept on disk pickles what its guards met, the cache and its
        # layers with it: the offloader goes as its id (its host memory, slots and copy
        # thread do not pickle, and the step finds it by id).
        return (KVOffloaderId, (self.id,))

    def check_compiled(self, layer: int, keys: torch.Tensor) -> None:
        """What a compiled step's cache update checks: the graph passed `layer`'s own
        slot view, not a copy (its writes would then miss the slot the host copy and the
        next layers are refilled from)."""
        if self._closed or keys.data_ptr() != self.views(layer)[0].data_ptr():
            raise RuntimeError(
                "the compiled graph passed a copy of an offloaded KV cache layer, not its slot"
            )

    def after_update(self, layer: int, positions: torch.Tensor, count: int) -> None:
        """`count` new positions (`positions`, on the device) were written into the
        slot: write the same rows back to the host copy."""
        self._write_back(layer, positions, count)
        self.lengths[layer] += count
        self.bytes_written_back += count * self.shape.row_bytes
        self._last = layer

    def count_replayed_step(self) -> None:
        """A CUDA graph replayed a decode step: every layer wrote one more position."""
        self.lengths = [length + 1 for length in self.lengths]  # (its bytes: in `replayed`)

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
        ops.unregister(self.id)
        if os.getpid() != self._pid:  # (a fork: the copy thread did not come along)
            return
        self._engine.synchronize()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._engine.close()  # its thread ends now, not when the cache is collected

    def stats(self) -> KVStats:
        return KVStats(
            copies=self._engine.collect_stats().snapshot(),
            bytes_written_back=self.bytes_written_back,
            host_bytes=self.host_bytes,
            device_bytes=self.device_bytes,
        )


@dataclass(frozen=True)
class KVOffloaderId:
    """What a pickled `KVOffloader` becomes: its id, nothing to run."""

    id: int
