"""Reversible module hooks: attach, pre-forward, post-forward, detach."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from offload.errors import ModelError
from offload.offloader import ops
from offload.offloader.units import Unit


class ModuleHooks:
    """Hooks registered on a module, removable together (`detach`)."""

    _handles: list[torch.utils.hooks.RemovableHandle]

    def detach(self) -> None:
        for handle in getattr(self, "_handles", []):
            handle.remove()
        self._handles = []


class AroundForward(ModuleHooks):
    """A hook before a module's forward and one after it, which runs even when the
    forward raises (so whatever the first one did is undone)."""

    def attach(self, module: nn.Module) -> AroundForward:
        self._handles = [
            module.register_forward_pre_hook(self._pre_forward),
            module.register_forward_hook(self._post_forward, always_call=True),
        ]
        return self

    def _pre_forward(self, module: nn.Module, args: tuple) -> None:
        raise NotImplementedError

    def _post_forward(self, module: nn.Module, args: tuple, output: object) -> None:
        raise NotImplementedError


class CopyOnForwardHook(AroundForward):
    """Runs a module with device copies of its offloaded parameters.

    Before the forward each offloaded parameter's data is swapped for a fresh copy on
    the compute device; after it (also when the forward raises) the host data is put
    back, so the copies are freed and the stored weights never change. Tied parameters
    are `Parameter` objects shared between modules, so every user sees the same copy.
    This is the synchronous path for when zero-copy views are unavailable; it is for
    inference (autograd would see the swapped data).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        device: torch.device,
        on_copy: Callable[[int], None],
    ):
        self._params = list(params)
        self._device = device
        self._on_copy = on_copy
        self._host_data: list[torch.Tensor] = []
        self._depth = 0  # a module may call itself; copy once, restore at the outermost exit
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _pre_forward(self, module: nn.Module, args: tuple) -> None:
        self._depth += 1
        if self._depth > 1:
            return
        self._host_data = [p.data for p in self._params]
        for param, host in zip(self._params, self._host_data, strict=True):
            # A new tensor even when the device is the CPU, so the copy really happens;
            # it is issued on the current stream, which the layer's kernels follow.
            copy = torch.empty_like(host, device=self._device)
            copy.copy_(host, non_blocking=True)
            param.data = copy
            self._on_copy(host.numel() * host.element_size())

    def _post_forward(self, module: nn.Module, args: tuple, output: object) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        self.recover()

    def recover(self) -> None:
        """Put the host data back (also after a forward that a Ctrl-C abandoned, which
        skips torch's post-forward hooks)."""
        for param, host in zip(self._params, self._host_data, strict=False):
            param.data = host
        self._host_data = []
        self._depth = 0


class PrefetchHook(ModuleHooks):
    """Brackets an offloaded layer: wait for its slot before the forward, start the next
    load into that slot after it. Eager calls go straight to the offloader; under
    torch.compile they go through the `offload::` custom ops, which tie them to the
    layer's activations (see `offload.offloader.ops`)."""

    def __init__(
        self, offloader_id: int, position: int, params: Sequence[tuple[str, nn.Parameter]]
    ):
        # The offloader by its id (`ops.register`) and the weights by their names in the
        # module, not references: a compiled step is kept on disk with a pickle of the
        # hooks its graph met (`engine/step_cache`), where the offloader's host memory and
        # locks do not pickle, and its weights must be found through the module's own
        # attributes (through the hooks' dict, a loaded step cannot find them).
        self._id = offloader_id
        self._position = position
        self._paths = [tuple(name.split(".")) for name, _ in params]
        # The input widths its weight matrices take (a linear layer's in_features; not a
        # norm's size, which for Qwen3's q/k norms is the head size of the rotary tables).
        self._widths = {p.shape[-1] for _, p in params if p.dim() >= 2}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def attach(self, module: nn.Module) -> PrefetchHook:
        self._handles = [
            module.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
            module.register_forward_hook(self._post_forward),
        ]
        return self

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.compiler.is_compiling():
            ops.offloader(self._id).wait(self._position)
            return
        activations = _streams(_float_tensors((args, kwargs)), self._widths)
        if not activations:
            raise RuntimeError(
                f"{type(module).__name__} got no floating-point tensor argument; under "
                "torch.compile the prefetch wait is ordered through the layer's inputs"
            )
        weights = self._weights(module)
        torch.ops.offload.wait_layer(activations, weights, self._id, self._position)

    def _post_forward(self, module: nn.Module, args: tuple, output: object) -> None:
        if not torch.compiler.is_compiling():
            ops.offloader(self._id).layer_done(self._position)
            return
        activations = _float_tensors(output)
        if not activations:
            raise RuntimeError(
                f"{type(module).__name__} returned no floating-point tensor; under "
                "torch.compile the next prefetch is ordered through the layer's outputs"
            )
        torch.ops.offload.start_layer(activations, self._weights(module), self._id, self._position)

    def _weights(self, module: nn.Module) -> list[torch.Tensor]:
        weights = []
        for path in self._paths:
            value = module
            for part in path:
                value = getattr(value, part)
            weights.append(value)
        return weights


class LayerBoundary(PrefetchHook):
    """A `PrefetchHook` without an offloader (`ops.NO_OFFLOADER`): in a compiled step of
    more than one row, the same ops at the same places as an offloader's, doing nothing.
    A compiled graph of the model resident then splits its fusions where an offloaded one
    must (its wait and start declare the layer's streams mutated), so the two compute
    alike: inductor fused a layer's residual add into the next layer's norm resident but
    not offloaded, and for a batch of rows that summed in another order. For one float32
    row the two agree without it, and it slowed the resident step (docs/benchmarks.md,
    "2026-11-28 (eighteenth session): compiled batches landed; the disk tier's batches
    were not exact"): there, and eagerly, it does nothing. A row of bfloat16 or float16
    takes it: a fused add keeps its sum in float32 registers where one split off rounds it
    to the dtype in memory, so the two differed in their last bits."""

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling() and not _one_float32_row(_float_tensors((args, kwargs))):
            super()._pre_forward(module, args, kwargs)

    def _post_forward(self, module: nn.Module, args: tuple, output: object) -> None:
        if torch.compiler.is_compiling() and not _one_float32_row(_float_tensors(output)):
            super()._post_forward(module, args, output)


def _one_float32_row(tensors: list[torch.Tensor]) -> bool:
    if not tensors or tensors[0].dtype != torch.float32:
        return False
    return tensors[0].numel() == tensors[0].shape[-1]


def attach_boundaries(layers: Sequence[nn.Module]) -> list[LayerBoundary]:
    """A `LayerBoundary` on each of `layers` that has no `PrefetchHook`. Detach them with
    their `detach`."""
    hooks = []
    for position, layer in enumerate(layers):
        own = [*layer._forward_pre_hooks.values(), *layer._forward_hooks.values()]
        if any(isinstance(getattr(hook, "__self__", None), PrefetchHook) for hook in own):
            continue
        params = list(layer.named_parameters())
        hooks.append(LayerBoundary(ops.NO_OFFLOADER, position, params).attach(layer))
    return hooks


class StateDictHooks(ModuleHooks):
    """Make an offloaded layer's `state_dict()` report its weights from host memory (its
    slot may hold another layer), and `load_state_dict()` write them there (a write to
    the slot alone would be lost at the next refill)."""

    def __init__(self, offloader, layer: Unit):
        self._offloader = offloader
        self._layer = layer
        self._handles = []

    def attach(self, module: nn.Module) -> StateDictHooks:
        self._handles = [
            module._register_state_dict_hook(self._saved),
            module._register_load_state_dict_pre_hook(self._loading),
        ]
        return self

    def _saved(self, module, state_dict, prefix, local_metadata) -> None:
        for name, param in self._layer.params:
            if prefix + name in state_dict:
                state_dict[prefix + name] = self._offloader.ledger.saved_value(
                    param, self._offloader.restore
                ).detach()

    def _loading(self, state_dict, prefix, *args) -> None:
        if self._layer.disk is not None and any(
            prefix + n in state_dict for n, _ in self._layer.params
        ):
            raise ModelError(
                f"the weights of {self._layer.name} stream from the checkpoint's files on disk "
                "and cannot be replaced in place; give it more host memory (cpu_memory_gb) or "
                "load the new weights from their own checkpoint"
            )
        # Slot contents are about to be overwritten by the default loading: forget them.
        self._offloader.reload()
        for name, param in self._layer.params:
            value = state_dict.get(prefix + name)
            host = self._offloader.ledger.host_view(param)
            if isinstance(value, torch.Tensor) and value.shape == host.shape:
                host.copy_(value)


def _streams(inputs: list[torch.Tensor], widths: set[int]) -> list[torch.Tensor]:
    """The inputs that carry a block's streams: the first floating-point one and every
    other whose last dimension is one its weights take (a second stream, a conditioning
    vector), not side tables such as rotary cos/sin (head size) or masks (key length).
    Declaring those mutated too would make inductor materialise them instead of fusing
    them into their readers, which measurably changed the last bits of some models'
    outputs (Falcon, Gemma 3, Qwen3-MoE) against the model compiled without offloading."""
    return inputs[:1] + [t for t in inputs[1:] if t.dim() and t.shape[-1] in widths]


def _float_tensors(value: object, found: list[torch.Tensor] | None = None) -> list:
    """Every floating-point tensor in a (nested) structure of args or outputs, each once:
    the streams a block reads or returns (hidden states, rotary tables, a second stream),
    not positions or boolean masks."""
    found = [] if found is None else found
    if isinstance(value, torch.Tensor):
        # (`is`, not a dict by id(): dynamo before torch 2.13 cannot trace id() of a tensor
        # made inside the graph, and fullgraph=True then fails)
        if value.is_floating_point() and not any(value is seen for seen in found):
            found.append(value)
    elif isinstance(value, dict):
        for item in value.values():
            _float_tensors(item, found)
    elif isinstance(value, list | tuple):
        for item in value:
            _float_tensors(item, found)
    return found
