"""Reversible module hooks: attach, pre-forward, post-forward, detach."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn


class ModuleHooks:
    """Hooks registered on a module, removable together (`detach`)."""

    _handles: list[torch.utils.hooks.RemovableHandle]

    def detach(self) -> None:
        for handle in getattr(self, "_handles", []):
            handle.remove()
        self._handles = []


class CopyOnForwardHook(ModuleHooks):
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

    def attach(self, module: nn.Module) -> CopyOnForwardHook:
        self._handles = [
            module.register_forward_pre_hook(self._pre_forward),
            module.register_forward_hook(self._post_forward, always_call=True),
        ]
        return self

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
        for param, host in zip(self._params, self._host_data, strict=True):
            param.data = host
        self._host_data = []


class PrefetchHook(ModuleHooks):
    """Brackets an offloaded layer: wait for its slot before the forward, start the next
    load into that slot after it. Eager calls go straight to the offloader; under
    torch.compile they go through the `offload::` custom ops, which tie them to the
    layer's activations (see `offload.offloader.ops`)."""

    def __init__(
        self, offloader, offloader_id: int, position: int, weights: Sequence[nn.Parameter]
    ):
        self._offloader = offloader
        self._id = offloader_id
        self._position = position
        self._weights = list(weights)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def attach(self, module: nn.Module) -> PrefetchHook:
        self._handles = [
            module.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
            module.register_forward_hook(self._post_forward),
        ]
        return self

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.compiler.is_compiling():
            self._offloader.wait_for_layer(self._position)
            return
        activation = _first_tensor((args, kwargs))
        if activation is None:
            raise RuntimeError(
                f"{type(module).__name__} got no tensor argument; under torch.compile the "
                "prefetch wait is ordered through the layer's input activation"
            )
        torch.ops.offload.wait_layer(activation, self._weights, self._id, self._position)

    def _post_forward(self, module: nn.Module, args: tuple, output: object) -> None:
        if not torch.compiler.is_compiling():
            self._offloader.layer_done(self._position)
            return
        activation = _first_tensor(output)
        if activation is None:
            raise RuntimeError(
                f"{type(module).__name__} returned no tensor; under torch.compile the next "
                "prefetch is ordered through the layer's output"
            )
        torch.ops.offload.start_layer(activation, self._weights, self._id, self._position)


def _first_tensor(value: object) -> torch.Tensor | None:
    """The first floating-point tensor in a (nested) structure of args or outputs: the
    hidden states for a transformer block (positions and masks are integer or later)."""
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None
