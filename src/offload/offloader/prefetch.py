"""Prefetch offloading: whole layers copied ahead of use into a ring of static device slots."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from offload.errors import ModelError
from offload.memory.copy_engine import CopyEngine, make_copy_engine
from offload.memory.host import HostSlab, TensorSpec, should_pin_memory
from offload.memory.slots import SlotTable, slot_of, slot_sizes
from offload.offloader import ops
from offload.offloader.base import BaseOffloader, OffloadedParam, set_param_data
from offload.offloader.hooks import ModuleHooks, PrefetchHook
from offload.offloader.selection import (
    matches_segments,
    offloaded_layer_indices,
    unmatched_segments,
)
from offload.offloader.unit_check import UnitReadCheck
from offload.offloader.units import UNITS, resolve_unit, slab_bytes, units_ahead


@dataclass
class _Layer:
    """One offloaded layer: its parameters, their packed host slab, and its position."""

    module: nn.Module
    name: str
    params: list[tuple[str, nn.Parameter]]
    specs: list[TensorSpec]
    slab: HostSlab | None = None
    owner: nn.Module | None = None  # the decoder layer it belongs to (itself, for layer units)
    address: int = 0  # where its first parameter lives in its slot (to catch replaced data)


class PrefetchOffloader(BaseOffloader):
    """vLLM's prefetch offloader, with whole-layer copies and provably safe slots.

    The last `num_in_group` layers of every `group_size` are offloaded (only the
    parameters matching `offload_params`, if given). Each offloaded layer's parameters
    are packed into one exact-size (pinned, on CUDA) host slab, so bringing a layer in
    is one copy. The device holds `prefetch_step` slots, each as large as the largest
    layer it serves; every offloaded parameter is a permanent view into its slot, so its
    address never changes (torch.compile and CUDA graphs keep working). After a layer
    runs, its slot is refilled with the next layer that uses it, on a copy stream (a
    worker thread with the CPU as compute device); see `memory/slots.py` for the schedule.

    Reading an offloaded parameter outside its layer's forward gives whatever layer its
    slot holds at that moment; the host copy (`manifest`, `host_tensor`) is the truth.
    """

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
        unit: str = "auto",
    ):
        super().__init__()
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
        self.group_size = group_size
        self.num_in_group = num_in_group
        self.prefetch_step = prefetch_step
        self.offload_params = set(offload_params or ())
        self.device = device
        self.disable_pin_memory = disable_pin_memory
        self._copy_engine_factory = copy_engine_factory
        self._warned_grad = False
        self._layers: list[_Layer] = []
        self._slots: list[torch.Tensor] = []
        self._tickets: list[object] = []
        self._running: set[int] = set()  # positions between their wait and their release
        self._unit_checks: dict[int, UnitReadCheck] = {}  # module units: position -> check
        self._table: SlotTable | None = None
        self._engine: CopyEngine | None = None
        # Compiled calls: thread -> the layer it is inside (see `_claim_for_compiled`).
        self._compiled_running: dict[int, int] = {}
        self._compiled_lock = threading.Lock()
        self._id = ops.register(self)

    # -- planning ------------------------------------------------------------

    def _plan(self, modules: list[nn.Module]) -> list[_Layer]:
        uses: dict[int, int] = {}
        for module in modules:
            for p in module.parameters():
                uses[id(p)] = uses.get(id(p), 0) + 1
        layers = []
        indices = offloaded_layer_indices(len(modules), self.group_size, self.num_in_group)
        if not indices:
            # As in vLLM, a layout that selects no layer offloads nothing; say so.
            warnings.warn(self._nothing_to_offload(len(modules)), UserWarning, stacklevel=4)
            return []
        if self.offload_params:
            names = [n for i in indices for n, _ in modules[i].named_parameters()]
            missing = unmatched_segments(names, self.offload_params)
            if missing and len(missing) < len(self.offload_params):
                warnings.warn(
                    f"offload_params {sorted(missing)} match no parameter; the others are used",
                    UserWarning,
                    stacklevel=4,
                )
        for index in indices:
            module = modules[index]
            params = [
                (name, p)
                for name, p in module.named_parameters()
                if (not self.offload_params or matches_segments(name, self.offload_params))
                and uses[id(p)] == 1  # weights tied to another layer stay resident
                and id(p) not in self._resident_param_ids
            ]
            for name, p in params:
                if p.is_meta and not self.deferred:
                    raise ModelError(f"parameter {name!r} of layer {index} is on the meta device")
            if params:  # as vLLM: a layer with nothing to offload is not offloaded
                name = self.module_name(module, index)
                specs = [TensorSpec.of(p) for _, p in params]
                layers.append(_Layer(module, name, params, specs, owner=module))
        layers = self._into_units(layers, modules)
        if not layers and self.offload_params:
            raise ModelError(self._nothing_to_offload(len(modules)))
        if not layers:
            warnings.warn(
                "the parameters of the layers to offload are all tied to other modules and "
                "stay resident: nothing is offloaded",
                UserWarning,
                stacklevel=4,
            )
        return layers

    def _into_units(self, layers: list[_Layer], modules: list[nn.Module]) -> list[_Layer]:
        """Resolve the unit for the compute device, split the layers into it, and set how
        many units ahead copies run."""
        params = (p for m in modules for p in m.parameters())
        device = self.device or next(params, torch.empty(0)).device
        largest_layer = max((_bytes_of(layer) for layer in layers), default=0)
        unit = resolve_unit(self.unit, device, largest_layer, self.prefetch_step)
        if unit == "module":
            layers = [part for layer in layers for part in _split_into_modules(layer)]
        sizes = [_bytes_of(layer) for layer in layers]
        self.prefetch_step = units_ahead(self.unit, unit, self.prefetch_step, sizes, largest_layer)
        self.unit = unit
        return layers

    @property
    def planned_staging_bytes(self) -> int:
        """The device memory the slots take (known from the plan, before `post_init`)."""
        slots = min(self.prefetch_step, len(self._layers))
        return sum(slot_sizes([_bytes_of(layer) for layer in self._layers], slots)) if slots else 0

    def _nothing_to_offload(self, num_layers: int) -> str:
        if self.offload_params:
            return (
                f"offload_params {sorted(self.offload_params)} match no parameter of the "
                f"offloaded layers (segments are matched whole, e.g. 'mlp' or 'q_proj')"
            )
        first = self.group_size - self.num_in_group
        return (
            f"offload_group_size={self.group_size} with offload_num_in_group="
            f"{self.num_in_group} offloads layers {first}, {first + 1}, ... but there are "
            f"only {num_layers} layers: nothing is offloaded"
        )

    # -- the vLLM contract ------------------------------------------------------

    def wrap_modules(self, modules: Iterable[nn.Module]) -> list[nn.Module]:
        if self._layers:
            raise ModelError("PrefetchOffloader.wrap_modules may be called only once")
        modules = list(modules)
        self._layers = self._plan(modules)
        for position, layer in enumerate(self._layers):
            self._move_to_host(layer)
            if self.dry_run:
                continue
            weights = [p for _, p in layer.params]
            self._hooks.append(PrefetchHook(self, self._id, position, weights).attach(layer.module))
            self._hooks.append(_StateDictHooks(self, layer).attach(layer.module))
        if self.unit == "module" and not self.dry_run:
            self._hooks += self._unit_read_checks()
        return modules

    def _unit_read_checks(self) -> list[UnitReadCheck]:
        """One check per offloaded layer over its module units (see `unit_check.py`)."""
        units: dict[int, list[int]] = {}
        for position, layer in enumerate(self._layers):
            units.setdefault(id(layer.owner), []).append(position)
        checks = []
        for positions in units.values():
            owner = self._layers[positions[0]].owner
            name = self.module_name(owner, positions[0])
            members = [(p, [param for _, param in self._layers[p].params]) for p in positions]
            checks.append(UnitReadCheck(self, owner, name, members))
            self._unit_checks.update(dict.fromkeys(positions, checks[-1]))
        return checks

    def _move_to_host(self, layer: _Layer) -> None:
        device = self.device or layer.params[0][1].device
        self.device = device
        pin = should_pin_memory(device, self.disable_pin_memory)
        location = "host-pinned" if pin else "host"
        if self.dry_run:
            self._manifest += [
                OffloadedParam.of(layer.name, n, p, location, "prefetch") for n, p in layer.params
            ]
            return
        layer.slab = HostSlab(layer.specs, pin_for=device if pin else None)
        for (name, param), host in zip(layer.params, layer.slab.views, strict=True):
            if not param.is_meta:  # (meta: a loader will read the checkpoint into `host`)
                host.copy_(param.data)
            self._take(param, host)
            set_param_data(param, host)  # frees the device copy; the slot view comes in post_init
            self._manifest.append(OffloadedParam.of(layer.name, name, host, location, "prefetch"))

    def post_init(self) -> None:
        """Allocate the slots, point every offloaded parameter at its slot for good, and
        start loading the first layer of each slot."""
        if not self._layers or self._slots or self.dry_run:
            return
        self._engine = self._copy_engine_factory(self.device)
        self._table = SlotTable(len(self._layers), self.prefetch_step)
        sizes = slot_sizes([layer.slab.num_bytes for layer in self._layers], self._table.slots)
        self._slots = [torch.empty(size, dtype=torch.uint8, device=self.device) for size in sizes]
        for position, layer in enumerate(self._layers):
            slot = self._slots[slot_of(position, self._table.slots)]
            for (_, param), spec, offset in zip(
                layer.params, layer.specs, layer.slab.offsets, strict=True
            ):
                param.data = spec.view_of(slot[offset : offset + spec.num_bytes])
            layer.address = layer.params[0][1].data_ptr()
        self._tickets = [None] * len(self._layers)
        for position in self._table.initial_loads():
            self._load(position)

    def _load(self, position: int) -> None:
        """Issue the copy of `position` into its slot. The table calls the slot unknown
        until the copy is queued and its ticket kept, so an exception or Ctrl-C at any
        point in here makes the slot's next user load it again (see `SlotTable`)."""
        layer = self._layers[position]
        num_bytes = layer.slab.num_bytes
        slot_index = slot_of(position, self._table.slots)
        slot = self._slots[slot_index]
        self._table.start_load(position)
        # Whoever ran in this slot no longer has its weights there.
        self._running.difference_update(
            [p for p in self._running if slot_of(p, self._table.slots) == slot_index]
        )
        if torch.is_grad_enabled():
            # Autograd may have saved the slot's previous weights for a backward pass: mark
            # them overwritten, so that backward fails loudly instead of using wrong weights.
            # (Each parameter has its own version counter, not the slot's.)
            slots = self._table.slots
            for other in self._layers[slot_index::slots]:
                for _, param in other.params:
                    torch.autograd.graph.increment_version(param)
        # The copy waits until every read issued so far (the slot's last user) is done.
        self._tickets[position] = self._engine.copy(
            slot[:num_bytes], layer.slab.buffer[:num_bytes], after=self._engine.mark_released()
        )
        self._table.finish_load(position)

    def wait_for_layer(
        self, position: int, weights: list[torch.Tensor] | None = None, *, running: bool = True
    ) -> None:
        """Before layer `position` runs: load it now if its slot holds another layer,
        then make compute wait until its copy has landed. (`running=False`: a read of its
        weights outside its forward, see `unit_check.py`.)"""
        layer = self._layers[position]
        if weights is not None:
            self._claim_for_compiled(position)
        if weights is not None and position in self._unit_checks:
            # Called from a compiled graph, where the read check cannot run.
            check = self._unit_checks[position]
            if not check.is_verified:
                raise ModelError(check.compile_error())
        if weights and weights[0].data_ptr() != layer.params[0][1].data_ptr():
            raise RuntimeError(
                "the compiled graph passed a copy of an offloaded weight, not its slot"
            )
        if layer.params[0][1].data_ptr() != layer.address:
            raise ModelError(
                f"the offloaded parameters of {layer.name} no longer live in their device slot "
                "(model.to(), load_state_dict(assign=True) or .data replaced them); change dtype "
                "or device before offloading, and load weights with load_state_dict()"
            )
        if torch.is_grad_enabled() and not self._warned_grad and self._shares_slots():
            self._warned_grad = True
            warnings.warn(
                "prefetch offloading is for inference: offloaded layers share device slots, so "
                "a backward pass through them fails; run forwards under torch.no_grad() or "
                "torch.inference_mode()",
                UserWarning,
                stacklevel=4,
            )
        if self._table.needs_load(position):
            self._load(position)
        self._engine.wait(self._tickets[position])
        if running:  # only once its bytes are there (see `is_running`)
            self._running.add(position)

    def is_running(self, position: int) -> bool:
        """True from the end of `position`'s wait to its release, while its slot holds it
        (a load into the slot takes it out of `_running`)."""
        slot = slot_of(position, self._table.slots)
        return position in self._running and self._table.owner[slot] == position

    def unit_name(self, position: int) -> str:
        return self._layers[position].name

    def _shares_slots(self) -> bool:
        return self._table.slots < len(self._layers)

    def reload(self) -> None:
        """Forget what the slots hold (after their contents were overwritten, e.g. by
        load_state_dict): every layer is brought in again from host memory before it runs."""
        if self._engine is None:
            return
        self._engine.synchronize()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._table = SlotTable(len(self._layers), self.prefetch_step)
        self._tickets = [None] * len(self._layers)
        self._running.clear()

    def layer_done(self, position: int, *, compiled: bool = False) -> None:
        """After layer `position` has run: refill its slot with the next layer using it."""
        self._running.discard(position)
        if compiled:
            self._release_for_compiled()
        following = self._table.next_load(position)
        if following is not None:
            self._load(following)

    def _claim_for_compiled(self, position: int) -> None:
        """A compiled graph bypasses the forward lock (torch.compile cannot trace it), so
        two threads could interleave their layers on shared slots: refuse, never compute
        on another layer's weights. Eager calls wait for each other instead."""
        me = threading.get_ident()
        with self._compiled_lock:
            self._check_alone_in_compiled(me)
            self._compiled_running[me] = position

    def _release_for_compiled(self) -> None:
        me = threading.get_ident()
        with self._compiled_lock:
            self._compiled_running.pop(me, None)
            self._check_alone_in_compiled(me)  # before a refill that another layer may need

    def _check_alone_in_compiled(self, me: int) -> None:
        others = [t for t in self._compiled_running if t != me]
        if others and {t.ident for t in threading.enumerate()} & set(others):
            raise ModelError(
                "a torch.compile'd offloaded model was called from two threads at once; its "
                "layers share device slots: serialize the calls (a threading.Lock around the "
                "compiled model), or call the model uncompiled, whose calls wait for each other"
            )

    def recover(self) -> None:
        """After an abandoned forward: nothing is running, no read check is active. The
        slot table needs nothing: it is consistent after an interrupt at any point."""
        self._running.clear()
        for check in {id(c): c for c in self._unit_checks.values()}.values():
            check.recover()
        self.forward_finished()

    def forward_started(self) -> None:
        """Copies from now on run beside compute (the copy thread's spin check)."""
        if self._engine is not None:
            self._engine.compute_busy = True

    def forward_finished(self) -> None:
        if self._engine is not None:
            self._engine.compute_busy = False

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()

    def sync_prev_onload(self) -> None:
        if self._engine is not None:
            self._engine.synchronize()

    def join_after_forward(self) -> None:
        if self._engine is not None:
            self._engine.synchronize()

    # -- reporting ------------------------------------------------------------

    def host_tensor(self, name: str) -> torch.Tensor:
        """The host copy of an offloaded parameter (by its manifest name)."""
        for layer in self._layers:
            for local, param in layer.params:
                if f"{layer.name}.{local}" == name:
                    return self._host_views[id(param)]
        raise KeyError(name)

    @property
    def device_staging_bytes(self) -> int:
        return sum(slot.numel() for slot in self._slots)

    @property
    def pinned_bytes(self) -> int:
        return sum(layer.slab.mapped_bytes for layer in self._layers if layer.slab.is_pinned)

    @property
    def host_bytes(self) -> int:
        return sum(layer.slab.mapped_bytes for layer in self._layers)

    def stats(self) -> dict[str, float | int]:
        copies = self._engine.collect_stats().as_dict() if self._engine else {}
        return {
            **super().stats(),
            "num_offloaded_layers": len({id(layer.owner) for layer in self._layers}),
            "num_units": len(self._layers),
            "unit": self.unit,
            "num_slots": len(self._slots),
            "device_staging_bytes": self.device_staging_bytes,
            "largest_layer_bytes": max((lay.slab.num_bytes for lay in self._layers), default=0),
            "host_bytes": self.host_bytes,
            "pinned_bytes": self.pinned_bytes,
            **copies,
        }


# With prefetch_unit="module", a module whose weights are less than this share of its
# layer's stays resident: a norm's few KiB are not worth a copy and a wait.
_SMALL_UNIT_SHARE = 1 / 64


def _bytes_of(layer: _Layer) -> int:
    return slab_bytes([spec.num_bytes for spec in layer.specs])


def _split_into_modules(layer: _Layer) -> list[_Layer]:
    """`layer` as one unit per module that holds its offloaded weights directly (its
    linear layers, in registration order, which is the order Hugging Face layers call
    them in; a module that runs out of that order is still correct, loaded on demand).
    Each unit is copied, waited for and released on its own, so a copy lands just before
    its module runs: on a CPU the bytes are still in cache when they are read. (Grouping
    neighbours into bigger units measured slower: more bytes in flight.)"""
    chosen = {id(p) for _, p in layer.params}
    units = []
    for sub_name, sub in layer.module.named_modules():
        params = [(n, p) for n, p in sub.named_parameters(recurse=False) if id(p) in chosen]
        chosen -= {id(p) for _, p in params}  # a parameter shared by two modules: once
        if params:
            name = f"{layer.name}.{sub_name}" if sub_name else layer.name
            specs = [TensorSpec.of(p) for _, p in params]
            units.append(_Layer(sub, name, params, specs, owner=layer.module))
    total = sum(spec.num_bytes for unit in units for spec in unit.specs)
    return [u for u in units if sum(s.num_bytes for s in u.specs) >= total * _SMALL_UNIT_SHARE]


class _StateDictHooks(ModuleHooks):
    """Make an offloaded layer's `state_dict()` report its weights from host memory (its
    slot may hold another layer), and `load_state_dict()` write them there (a write to
    the slot alone would be lost at the next refill)."""

    def __init__(self, offloader: PrefetchOffloader, layer: _Layer):
        self._offloader = offloader
        self._layer = layer
        self._handles = []

    def attach(self, module: nn.Module) -> _StateDictHooks:
        self._handles = [
            module._register_state_dict_hook(self._saved),
            module._register_load_state_dict_pre_hook(self._loading),
        ]
        return self

    def _saved(self, module, state_dict, prefix, local_metadata) -> None:
        for name, param in self._layer.params:
            if prefix + name in state_dict:
                state_dict[prefix + name] = self._offloader.host_view(param).detach()

    def _loading(self, state_dict, prefix, *args) -> None:
        # Slot contents are about to be overwritten by the default loading: forget them.
        self._offloader.reload()
        for name, param in self._layer.params:
            value = state_dict.get(prefix + name)
            host = self._offloader.host_view(param)
            if isinstance(value, torch.Tensor) and value.shape == host.shape:
                host.copy_(value)
