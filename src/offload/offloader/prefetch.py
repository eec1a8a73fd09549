"""Prefetch offloading: whole layers copied ahead of use into a ring of static device slots."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import replace

import torch
from torch import nn

from offload.config import PrefetchUnit
from offload.errors import ModelError
from offload.memory.copy_engine import CopyEngine, CopyStats, make_copy_engine
from offload.memory.disk_layout import slot_buffer
from offload.memory.host import should_pin_memory
from offload.memory.placement import DiskIO, Placement
from offload.memory.slots import SlotTable, slot_of, slot_sizes
from offload.offloader import ops
from offload.offloader.base import BaseOffloader
from offload.offloader.compiled_calls import CompiledCalls
from offload.offloader.disk_tier import DiskTier, NoDiskTier
from offload.offloader.hooks import PrefetchHook, StateDictHooks
from offload.offloader.manifest import OffloadedParam, set_param_data
from offload.offloader.module_units import LayerUnits, ModuleUnits
from offload.offloader.prefetch_plan import LayerChoice
from offload.offloader.sources import SlabSource, UnitSource
from offload.offloader.stats import OffloadStats
from offload.offloader.units import UNITS, Unit, resolve_unit, units_ahead


class PrefetchOffloader(BaseOffloader):
    """vLLM's prefetch offloader, with whole-layer copies and provably safe slots.

    The last `num_in_group` layers of every `group_size` are offloaded (only the parameters
    matching `offload_params`, if given), each packed into one exact-size (pinned, on CUDA) host
    slab: bringing a layer in is one copy. The device holds `prefetch_step` slots, each as large as
    the largest layer it serves; an offloaded parameter is a permanent view into its slot (its
    address never changes: torch.compile and CUDA graphs keep working). After a layer runs, its
    slot is refilled with the next layer using it, on a copy stream (a worker thread on the CPU);
    see `memory/slots.py`. A disk tier reads layers beyond the host budget from the checkpoint's
    files instead, or maps them (`disk_tier.py`). Outside its layer's forward, a parameter reads
    what its slot holds then; the host copy (`host_tensor`) or the file is the truth."""

    def __init__(
        self,
        group_size: int,
        num_in_group: int,
        prefetch_step: int,
        offload_params: Iterable[str] | None = None,
        mode: str = "cpu",
        *,
        device: torch.device | None = None,
        disable_pin_memory: bool = False,
        copy_engine_factory: Callable[[torch.device], CopyEngine] = make_copy_engine,
        unit: str = PrefetchUnit.AUTO,
        disk: DiskTier | None = None,
    ):
        super().__init__(disable_pin_memory=disable_pin_memory)
        if unit not in UNITS:
            raise ModelError(f"prefetch unit must be one of {', '.join(UNITS)}, got {unit!r}")
        self.unit = unit  # "auto" until `wrap_modules` knows the device (see units.py)
        if mode != "cpu":
            raise ModelError(f"PrefetchOffloader mode must be 'cpu' (host memory), got {mode!r}")
        if group_size < 1 or not 1 <= num_in_group <= group_size or prefetch_step < 1:
            raise ModelError(
                f"prefetch offloading needs group_size >= 1, 1 <= num_in_group <= group_size "
                f"and prefetch_step >= 1; got {group_size}, {num_in_group}, {prefetch_step}"
            )
        self.layer_choice = LayerChoice(group_size, num_in_group, offload_params or ())
        self.prefetch_step = prefetch_step
        self._asked = (unit, prefetch_step)  # what each plan starts from (it resolves both)
        self.device = device
        self._copy_engine_factory = copy_engine_factory
        self._warned_grad = False
        self._layers: list[Unit] = []  # by position, in execution order
        self._units: ModuleUnits | LayerUnits = LayerUnits()  # what module units need more
        self._slots: list[torch.Tensor] = []
        self._tickets: list[object] = []
        self._sources: list[UnitSource] = []  # by position: where its bytes come from
        self._table: SlotTable | None = None
        self._engine: CopyEngine | None = None
        self._compiled_calls = CompiledCalls()
        self._disk = disk or NoDiskTier()  # units beyond the host budget stream from disk
        self._wrapped = False
        self._id = ops.register(self)

    # -- planning ------------------------------------------------------------

    def plan(self, modules: Iterable[nn.Module]) -> list[OffloadedParam]:
        """Also resolves `unit` and `prefetch_step`, and so `planned_staging_bytes`."""
        self._layers = self._plan(list(modules), deferred=True)
        return self._planned_entries()

    def _planned_entries(self) -> list[OffloadedParam]:
        if not self._layers:
            return []
        device = self.device or self._layers[0].params[0][1].device
        location = OffloadedParam.location_of(should_pin_memory(device, self.disable_pin_memory))
        return [
            OffloadedParam.of(
                layer.name, n, p, Placement.DISK if layer.disk else location, "prefetch"
            )
            for layer in self._layers
            for n, p in layer.params
        ]

    def _plan(self, modules: list[nn.Module], deferred: bool) -> list[Unit]:
        # A plan, then the wrap that carries it out, resolve the same unit and step.
        self.unit, self.prefetch_step = self._asked
        choice = self.layer_choice
        layers = choice.layers(modules, self.ledger.resident_ids, self.ledger.module_name, deferred)
        if layers is None:  # the layout picks no layer (and said so)
            return []
        units = self._into_units(layers, modules)
        choice.check_some_offloaded(units, len(modules))
        device = self.device or units[0].params[0][1].device
        streaming_step = max(self.prefetch_step, self._disk.read_ahead + 1)
        if self._disk.place(units, device, streaming_step):  # some units stream
            self.prefetch_step = streaming_step
        return units

    def _into_units(self, layers: list[Unit], modules: list[nn.Module]) -> list[Unit]:
        """Resolve the unit for the device, split the layers into it, set the units ahead."""
        params = (p for m in modules for p in m.parameters())
        device = self.device or next(params, torch.empty(0)).device
        largest_layer = max((layer.num_bytes for layer in layers), default=0)
        unit = resolve_unit(self.unit, device, largest_layer, self.prefetch_step)
        if self._disk.reads_whole_layers and self.unit == PrefetchUnit.AUTO:
            unit = PrefetchUnit.LAYER
        self._units = ModuleUnits(self) if unit == PrefetchUnit.MODULE else LayerUnits()
        layers = self._units.split(layers)
        sizes = [layer.num_bytes for layer in layers]
        self.prefetch_step = units_ahead(self.unit, unit, self.prefetch_step, sizes, largest_layer)
        self.unit = unit
        return layers

    @property
    def planned_staging_bytes(self) -> int:
        """The device memory the slots take (known from the plan, before `post_init`)."""
        slots = min(self.prefetch_step, len(self._layers))
        sizes = [layer.slot_bytes for layer in self._layers]
        return sum(slot_sizes(sizes, slots)) if slots else 0

    # -- the vLLM contract ------------------------------------------------------

    def wrap_modules(
        self, modules: Iterable[nn.Module], *, deferred: bool = False
    ) -> list[nn.Module]:
        if self._wrapped:
            raise ModelError("PrefetchOffloader.wrap_modules may be called only once")
        self._wrapped = True
        modules = list(modules)
        self._layers = self._plan(modules, deferred)
        if not self._layers:
            return modules
        self.device = self.device or self._layers[0].params[0][1].device
        for position, layer in enumerate(self._layers):
            if layer.disk is not None:
                for _, param in layer.params:
                    self.ledger.take(param, None)  # its bytes stay in the checkpoint's file
            else:
                layer.slab = self.ledger.pack_into_slab(layer.params, self.device)
                for (_, param), host in zip(layer.params, layer.slab.views, strict=True):
                    set_param_data(param, host)  # frees the device copy; the slot: post_init
            self.ledger.hooks.append(
                PrefetchHook(self._id, position, layer.params).attach(layer.module)
            )
            self.ledger.hooks.append(StateDictHooks(self, layer).attach(layer.module))
        self.ledger.hooks += self._units.attach_read_checks(self._layers)
        self.ledger.entries += self._planned_entries()
        return modules

    def post_init(self) -> None:
        """Allocate the slots, point every offloaded parameter at its slot for good, and
        start loading the first layer of each slot."""
        if not self._layers or self._slots:
            return
        self._engine = self._copy_engine_factory(self.device)
        self._disk.map_files(self._layers)  # mapped units need no slot
        self._table = SlotTable(len(self._layers), self.prefetch_step)
        sizes = slot_sizes([layer.slot_bytes for layer in self._layers], self._table.slots)
        self._slots = [slot_buffer(size, self.device, self._streams()) for size in sizes]
        on_disk = self._disk.start(self.device, self._engine, sizes)
        in_host = SlabSource(self._engine)
        self._sources = [in_host if lay.disk is None else on_disk for lay in self._layers]
        for position, layer in enumerate(self._layers):
            slot = self._slots[slot_of(position, self._table.slots)]
            raws = self._sources[position].views(layer, slot)
            for (_, param), spec, raw in zip(layer.params, layer.specs, raws, strict=True):
                set_param_data(param, spec.view_of(raw))
            layer.address = layer.params[0][1].data_ptr()
        self._tickets = [None] * len(self._layers)
        for position in self._table.initial_loads():
            self._load(position)

    def _load(self, position: int) -> None:
        """Issue the copy of `position` into its slot. The table calls the slot unknown
        until the copy is queued and its ticket kept, so an exception or Ctrl-C at any
        point in here makes the slot's next user load it again (see `SlotTable`)."""
        layer = self._layers[position]
        slot_index = slot_of(position, self._table.slots)
        slot = self._slots[slot_index]
        self._table.start_load(position)
        self._units.slot_refilled(position, self._table.slots)
        if torch.is_grad_enabled():
            # Autograd may have saved the slot's previous weights: mark them overwritten, so that
            # backward fails loudly (each parameter has its own version counter, not the slot).
            for other in self._layers[slot_index :: self._table.slots]:
                other.mark_overwritten()
        self._tickets[position] = self._sources[position].load(layer, slot_index, slot)
        self._table.finish_load(position)

    def wait(self, position: int) -> None:
        """Before unit `position` runs (eager, or after `check_compiled`): its bytes are in
        its slot when compute reads them."""
        self.ensure_loaded(position)
        self._units.started(position)  # only once its bytes are there

    def ensure_loaded(self, position: int) -> None:
        """Load `position` now if its slot holds another unit, then make compute wait
        until its copy has landed (also for a read of its weights outside its forward,
        see `unit_check.py`)."""
        self._layers[position].check_in_slot()
        self._warn_if_grad()
        if self._table.needs_load(position):
            self._load(position)
        self._sources[position].wait(self._tickets[position])

    def check_compiled(self, position: int, weights: list[torch.Tensor]) -> None:
        """What a compiled graph's wait checks before `wait`: it runs alone, its layer
        passed the read check (module units), and it passes the slot's own weights."""
        self._compiled_calls.claim(position)
        self._units.check_compiled(position)
        if weights and weights[0].data_ptr() != self._layers[position].params[0][1].data_ptr():
            raise RuntimeError(
                "the compiled graph passed a copy of an offloaded weight, not its slot"
            )

    def holds(self, position: int) -> bool:
        """True while `position`'s slot holds it (its copy issued, perhaps not landed)."""
        return not self._table.needs_load(position)

    def _warn_if_grad(self) -> None:
        shared = self._table.slots < len(self._layers)  # a slot serves several layers
        if torch.is_grad_enabled() and not self._warned_grad and shared:
            self._warned_grad = True
            warnings.warn(
                "prefetch offloading is for inference: offloaded layers share device slots, so "
                "a backward pass through them fails; run forwards under torch.no_grad() or "
                "torch.inference_mode()",
                UserWarning,
                stacklevel=5,
            )

    def reload(self) -> None:
        """Forget what the slots hold (after their contents were overwritten, e.g. by
        load_state_dict): every layer is brought in again from host memory before it runs."""
        if self._engine is None:
            return
        self._engine.synchronize()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._forget_slots()

    def _forget_slots(self) -> None:
        self._disk.invalidate()  # no read issued so far lands after this
        if self._engine is not None:
            # Nor a copy: one queued by an abandoned forward would land over whatever the
            # next forward reads from disk into the slot it shares (test_fault_injection_disk).
            self._engine.synchronize()
        self._table = SlotTable(len(self._layers), self.prefetch_step)
        self._tickets = [None] * len(self._layers)
        self._units.forget_running()

    def _streams(self) -> bool:  # the disk tier: some unit streams from the checkpoint
        return self._disk.num_units > 0

    @property
    def disk_io(self) -> DiskIO | None:
        return self._disk.disk_io

    def restore(self, param: nn.Parameter) -> torch.Tensor:
        return self._disk.read_tensor(param)

    def layer_done(self, position: int, *, compiled: bool = False) -> None:
        """After layer `position` has run: refill its slot with the next layer using it."""
        self._units.released(position)
        if compiled:
            self._compiled_calls.release()
        self._sources[position].release(self._layers[position])
        following = self._table.next_load(position)
        if following is not None:
            self._load(following)

    def recover(self) -> None:
        """After an abandoned forward: nothing is running, no read check is active. The
        slot table is consistent after an interrupt at any point; with a disk tier, the
        reads left in flight are forgotten and every slot is loaded again."""
        self._units.recover()
        if self._streams() and self._engine is not None:
            self._forget_slots()
        self.forward_finished()

    def forward_started(self) -> None:
        """Copies from now on run beside compute (the copy thread's spin check). After a
        forward that failed on a disk read error, every slot is loaded again."""
        if self._disk.failed_transiently():
            self._forget_slots()
        if self._engine is not None:
            self._engine.compute_busy = True

    def forward_finished(self) -> None:
        if self._engine is not None:
            self._engine.compute_busy = False
        self._disk.leave()  # no forward reads a mapped file now

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
        self._disk.close()

    def sync_prev_onload(self) -> None:
        if self._engine is not None:
            self._engine.synchronize()

    join_after_forward = sync_prev_onload  # both: compute waits for every copy issued

    # -- reporting ------------------------------------------------------------

    @property
    def device_staging_bytes(self) -> int:
        return sum(slot.numel() for slot in self._slots)

    @property
    def copy_engine(self) -> CopyEngine | None:
        """The engine copying units into their slots: made by `post_init`, None before."""
        return self._engine

    def stats(self) -> OffloadStats:
        copies = self._engine.collect_stats().snapshot() if self._engine else CopyStats()
        return replace(
            super().stats(),
            copies=copies,
            unit=self.unit,
            num_offloaded_layers=self._units.num_layers,
            num_units=len(self._layers),
            num_slots=len(self._slots),
            device_staging_bytes=self.device_staging_bytes,
            largest_layer_bytes=max((lay.slot_bytes for lay in self._layers), default=0),
            disk=self._disk.stats(),
        )
