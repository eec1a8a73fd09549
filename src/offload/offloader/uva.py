"""UVA offloading: parameters move to host memory, and compute reads them in place."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
from torch import nn

from offload.errors import ModelError
from offload.memory.host import (
    HostSlab,
    TensorSpec,
    device_view,
    should_pin_memory,
    zero_copy_available,
)
from offload.offloader.base import BaseOffloader, OffloadedParam, set_param_data
from offload.offloader.hooks import CopyOnForwardHook
from offload.offloader.selection import (
    matches_segments,
    select_within_budget,
    unmatched_segments,
)


class UVAOffloader(BaseOffloader):
    """vLLM's UVA offloader: up to `cpu_offload_max_bytes` of parameters, taken in
    module order (per parameter, so a module may be partly offloaded), move into one
    exact-size host slab per module.

    On CUDA the slab is pinned and each parameter becomes a zero-copy device view of it.
    On the CPU the parameter simply is its slice of the slab. Where views are not
    available or are disabled (`disable_uva`, `VLLM_WEIGHT_OFFLOADING_DISABLE_UVA`), a
    hook copies the module's offloaded parameters to the device for each forward.
    """

    def __init__(
        self,
        cpu_offload_max_bytes: int,
        cpu_offload_params: Iterable[str] | None = None,
        *,
        device: torch.device | None = None,
        disable_uva: bool = False,
        disable_pin_memory: bool = False,
    ):
        super().__init__()
        self.cpu_offload_max_bytes = int(cpu_offload_max_bytes)
        self.cpu_offload_params = set(cpu_offload_params or ())
        self.device = device
        self.disable_uva = disable_uva
        self.disable_pin_memory = disable_pin_memory
        self._slabs: list[HostSlab] = []
        self._warned_moved = False
        self._eligible_bytes = 0
        self._num_wrapped = 0
        self.bytes_copied = 0
        self.num_copies = 0

    # -- planning: nothing is touched until the whole plan is known to be valid --

    def _plan(self, modules: list[nn.Module]) -> list[list[str]]:
        """Per module, the local names of the parameters to offload. A parameter shared
        by several modules is planned once, with the first; resident-pinned ones never."""
        used = self.offloaded_bytes
        seen = set(self._host_views) | self._resident_param_ids
        plan: list[list[str]] = []
        names_seen: list[str] = []
        for module in modules:
            named = [(n, p) for n, p in module.named_parameters() if id(p) not in seen]
            if not self.deferred:
                _check_not_meta(named, module)
            sizes = [(name, p.numel() * p.element_size()) for name, p in named]
            names_seen += [name for name, _ in sizes]
            chosen = select_within_budget(
                sizes, self.cpu_offload_max_bytes, used, self.cpu_offload_params
            )
            taken = set(chosen)
            used += sum(size for name, size in sizes if name in taken)
            seen.update(id(p) for n, p in named if n in taken)
            self._eligible_bytes += sum(
                size for name, size in sizes if _eligible(name, self.cpu_offload_params)
            )
            plan.append(chosen)
        self._check_segments(names_seen)
        return plan

    def _check_segments(self, names: list[str]) -> None:
        if not self.cpu_offload_params:
            return
        missing = unmatched_segments(names, self.cpu_offload_params)
        if missing == self.cpu_offload_params:
            example = names[0] if names else "(the modules have no parameters)"
            raise ModelError(
                f"cpu_offload_params {sorted(missing)} match no parameter of the wrapped "
                f"modules; names are matched by whole dot-separated segments, e.g. {example!r}"
            )
        if missing:
            warnings.warn(
                f"cpu_offload_params {sorted(missing)} match no parameter; the others are used",
                UserWarning,
                stacklevel=3,
            )

    # -- doing --

    def wrap_modules(
        self,
        modules: Iterable[nn.Module],
        submodule_accessor: object = None,
        whitelist_param_names_creator: object = None,
    ) -> list[nn.Module]:
        """Offload parameters of `modules` in order until the budget is reached. The two
        extra arguments exist for vLLM callers; as in vLLM, UVA ignores them."""
        modules = list(modules)
        if self.cpu_offload_max_bytes <= 0:
            return modules
        plan = self._plan(modules)
        for module, chosen in zip(modules, plan, strict=True):
            if chosen:
                self._offload(module, chosen)
            self._num_wrapped += 1
        return modules

    def _offload(self, module: nn.Module, chosen: list[str]) -> None:
        params = dict(module.named_parameters())
        device = self.device or params[chosen[0]].device
        pin = should_pin_memory(device, self.disable_pin_memory)
        prefix = self.module_name(module, self._num_wrapped)
        if self.dry_run:
            access = (
                "zero-copy"
                if zero_copy_available(device, pin, self.disable_uva)
                else "copy-per-forward"
            )
            location = "host-pinned" if pin else "host"
            self._manifest += [
                OffloadedParam.of(prefix, n, params[n], location, access) for n in chosen
            ]
            return
        slab = HostSlab([TensorSpec.of(params[n]) for n in chosen], pin_for=device if pin else None)
        zero_copy = zero_copy_available(device, slab.is_pinned, self.disable_uva)
        location = "host-pinned" if slab.is_pinned else "host"
        access = "zero-copy" if zero_copy else "copy-per-forward"
        for name, host in zip(chosen, slab.views, strict=True):
            param = params[name]
            if not param.is_meta:  # (meta: a loader will read the checkpoint into `host`)
                host.copy_(param.data)  # device (or CPU) -> slab; the old storage is freed below
            view = device_view(host, device) if zero_copy and device.type == "cuda" else host
            self._take(param, host)
            set_param_data(param, view)
            self._manifest.append(OffloadedParam.of(prefix, name, host, location, access))
        self._slabs.append(slab)
        if not zero_copy:
            mine = [p for p in module.parameters() if id(p) in self._host_views]
            self._hooks.append(CopyOnForwardHook(mine, device, self._count_copy).attach(module))

    def recover(self) -> None:
        for hook in self._hooks:
            if isinstance(hook, CopyOnForwardHook):
                hook.recover()

    def _count_copy(self, num_bytes: int) -> None:
        self.bytes_copied += num_bytes
        self.num_copies += 1

    def post_init(self) -> None:
        budget = self.cpu_offload_max_bytes
        if 0 < self._eligible_bytes < budget:
            warnings.warn(
                f"cpu_offload_gb ({budget / 1024**3:.3g} GiB) is more than the "
                f"{self._eligible_bytes / 1024**3:.3g} GiB of offloadable parameters in the "
                "wrapped layers; all of them were offloaded",
                UserWarning,
                stacklevel=2,
            )

    @property
    def slabs(self) -> tuple[HostSlab, ...]:
        """The host slabs holding the offloaded parameters, one per wrapped module."""
        return tuple(self._slabs)

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes held (exact slab sizes rounded to whole pages)."""
        return sum(slab.mapped_bytes for slab in self._slabs if slab.is_pinned)

    @property
    def host_bytes(self) -> int:
        """All host bytes held for offloaded parameters, pinned or not."""
        return sum(slab.mapped_bytes for slab in self._slabs)

    def _still_offloaded(self) -> list[OffloadedParam]:
        """Entries whose parameter still reads its host slab (a zero-copy device view has
        the slab's address): `model.to()` or an assignment makes a parameter resident."""
        if self.dry_run:
            return self._manifest
        still, moved = [], []
        for entry, (param, _) in zip(self._manifest, self._taken, strict=True):
            same = param.data_ptr() == self._host_views[id(param)].data_ptr()
            (still if same else moved).append(entry)
        if moved and not self._warned_moved:
            self._warned_moved = True
            warnings.warn(
                f"{len(moved)} offloaded parameters (e.g. {moved[0].name}) no longer live in "
                "host memory: model.to() or an assignment replaced their data, so they are "
                "resident now; change dtype or device before offloading",
                UserWarning,
                stacklevel=3,
            )
        return still

    def stats(self) -> dict[str, int]:
        return {
            **super().stats(),
            "host_bytes": self.host_bytes,
            "pinned_bytes": self.pinned_bytes,
            "bytes_copied": self.bytes_copied,
            "num_copies": self.num_copies,
        }


def _eligible(name: str, segments: set[str]) -> bool:
    return not segments or matches_segments(name, segments)


def _check_not_meta(named: list[tuple[str, nn.Parameter]], module: nn.Module) -> None:
    for name, param in named:
        if param.is_meta:
            raise ModelError(
                f"parameter {name!r} of {type(module).__name__} is on the meta device; "
                "load real weights before offloading"
            )
