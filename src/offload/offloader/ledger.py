"""What an offloader took, and where it keeps it: the manifest of offloaded parameters,
the host slabs and views holding their bytes (or the file they stay in), the hooks it
attached, and the undo of all of it. Each offloader owns one `Ledger`; the contract in
`base.py` stays vLLM's."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from offload.memory.host import HostSlab, TensorSpec, should_pin_memory
from offload.offloader.manifest import OffloadedParam, set_param_data

# How an offloader reads back a taken parameter that has no host copy (its file).
Restore = Callable[[nn.Parameter], torch.Tensor]


class Ledger:
    """The parameters an offloader took, their host bytes, its hooks, and their undo."""

    def __init__(self, *, disable_pin_memory: bool = False) -> None:
        self.disable_pin_memory = disable_pin_memory
        self.entries: list[OffloadedParam] = []  # the manifest, in the order they moved
        self.slabs: list[HostSlab] = []  # the host memory holding offloaded parameters
        self.host_views: dict[int, torch.Tensor] = {}  # by id(param): where its bytes are
        self.hooks: list[Any] = []  # attached hooks (each has detach())
        self.resident_ids: set[int] = set()  # parameters never to offload
        # (parameter, the device it was on) for each parameter taken, to undo a failed apply
        self.taken: list[tuple[nn.Parameter, torch.device]] = []
        self._on_disk: set[int] = set()  # taken parameters whose bytes stay in a file
        self._module_names: dict[int, str] = {}

    def name_modules(self, root: nn.Module) -> None:
        """Learn qualified module names from `root`, so the manifest names parameters
        as `root.named_parameters()` does."""
        self._module_names = {id(module): name for name, module in root.named_modules()}

    def module_name(self, module: nn.Module, index: int) -> str:
        return self._module_names.get(id(module), f"wrapped.{index}")

    def keep_resident(self, params: Iterable[nn.Parameter]) -> None:
        """Never offload these parameters (for instance, weights tied to modules
        outside the wrapped layers)."""
        self.resident_ids.update(id(p) for p in params)

    def take(self, param: nn.Parameter, host: torch.Tensor | None) -> None:
        """Record that `param`'s bytes now live in `host` (this offloader owns it), or,
        without a host tensor, in the checkpoint's file on disk."""
        device = param.device  # before its data moves: where undo puts it back
        if host is None:
            self._on_disk.add(id(param))
            if not param.is_meta:  # its memory is freed now; a backend points it elsewhere
                empty = nn.Parameter(torch.empty_like(param, device="meta"), param.requires_grad)
                torch.utils.swap_tensors(param, empty)
        else:
            self.host_views[id(param)] = host
        self.taken.append((param, device))
        param._offload_taken = True  # (an attribute: it survives swap_tensors, no weakref)

    def pack_into_slab(
        self, named: list[tuple[str, nn.Parameter]], device: torch.device
    ) -> HostSlab:
        """One exact-size host slab for `named` (pinned where a CUDA device reads it),
        holding their values, each parameter taken (see `take`). Their data is left as it
        is: each backend points them where compute reads them."""
        pin = should_pin_memory(device, self.disable_pin_memory)
        slab = HostSlab([TensorSpec.of(p) for _, p in named], pin_for=device if pin else None)
        for (_, param), host in zip(named, slab.views, strict=True):
            if not param.is_meta:  # (meta: a loader will read the checkpoint into `host`)
                host.copy_(param.data)
            self.take(param, host)
        self.slabs.append(slab)
        return slab

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes held (exact slab sizes rounded to whole pages)."""
        return sum(slab.mapped_bytes for slab in self.slabs if slab.is_pinned)

    @property
    def host_bytes(self) -> int:
        """All host bytes held for offloaded parameters, pinned or not."""
        return sum(slab.mapped_bytes for slab in self.slabs)

    def is_offloaded(self, param: torch.Tensor) -> bool:
        return id(param) in self.host_views or id(param) in self._on_disk

    def on_disk(self, param: torch.Tensor) -> bool:
        """Whether an offloaded parameter's bytes stay in the checkpoint's file."""
        return id(param) in self._on_disk

    def host_view(self, param: torch.Tensor) -> torch.Tensor | None:
        """Where an offloaded parameter's bytes live on the host (a loader writes there);
        None for a parameter this offloader did not take."""
        return self.host_views.get(id(param))

    def saved_value(self, param: torch.Tensor, restore: Restore) -> torch.Tensor:
        """An offloaded parameter's true value: its host copy, or read from where it is."""
        host = self.host_view(param)
        return host if host is not None else restore(param)

    def host_tensor(self, name: str, restore: Restore) -> torch.Tensor:
        """The host copy of an offloaded parameter (by its manifest name)."""
        for entry, (param, _) in zip(self.entries, self.taken, strict=True):
            if entry.name == name:
                return self.saved_value(param, restore)
        raise KeyError(name)

    def undo(self, restore: Restore) -> None:
        """Give back everything taken so far (after a failed `apply`): hooks detached,
        each parameter's values back on the device it came from."""
        for hook in self.hooks:
            hook.detach()
        self.hooks = []
        for param, device in reversed(self.taken):
            param._offload_taken = False
            if id(param) in self._on_disk:  # its bytes are in the checkpoint: read them back
                self._on_disk.discard(id(param))
                if device.type != "meta":
                    set_param_data(param, restore(param).to(device))
                continue
            host = self.host_views.pop(id(param))
            if not param.is_meta and device.type != "meta":  # (meta: never had values)
                param.data = host if device.type == "cpu" else host.to(device)
        self.taken = []
        self.entries = []
