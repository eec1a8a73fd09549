"""Reversible module hooks: attach, pre-forward, post-forward, detach."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn


class CopyOnForwardHook:
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

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

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
