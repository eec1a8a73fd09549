"""UVA offloading: parameters move to host memory, and compute reads them in place."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
from torch import nn

from offload.errors import ModelError
from offload.memory.copy_engine import CopyStats
from offload.memory.host import HostSlab, device_view, should_pin_memory, zero_copy_available
from offload.offloader.base import BaseOffloader
from offload.offloader.hooks import CopyOnForwardHook
from offload.offloader.manifest import (
    OffloadedParam,
    check_not_meta,
    set_param_data,
    warn_unmatched_segments,
)
from offload.offloader.selection import matches_segments, select_within_budget
from offload.offloader.stats import OffloadStats


@dataclass
class _Chosen:
    """The parameters of one wrapped module that move to its host slab."""

    module: nn.Module
    name: str
    params: list[tuple[str, nn.Parameter]]


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
        super().__init__(disable_pin_memory=disable_pin_memory)
        self.cpu_offload_max_bytes = int(cpu_offload_max_bytes)
        self.cpu_offload_params = set(cpu_offload_params or ())
        self.device = device
        self.disable_uva = disable_uva
        self._warned_moved = False
        self._eligible_bytes = 0
        self._num_wrapped = 0
        self.bytes_copied = 0
        self.num_copies = 0

    # -- planning: nothing is touched until the whole plan is known to be valid --

    def plan(self, modules: Iterable[nn.Module]) -> list[OffloadedParam]:
        modules = list(modules)
        if self.cpu_offload_max_bytes <= 0:
            return []
        chosen, _ = self._plan(modules, deferred=True)
        return [entry for part in chosen if part.params for entry in self._entries(part, None)]

    def _plan(self, modules: list[nn.Module], deferred: bool) -> tuple[list[_Chosen], int]:
        """Per module, the parameters to offload, and the bytes that `cpu_offload_params`
        makes eligible. A parameter shared by several modules is planned once, with the
        first; resident-pinned ones never."""
        used = self.offloaded_bytes
        seen = set(self.ledger.host_views) | self.ledger.resident_ids
        plan: list[_Chosen] = []
        names_seen: list[str] = []
        eligible_bytes = 0
        for index, module in enumerate(modules, start=self._num_wrapped):
            named = [(n, p) for n, p in module.named_parameters() if id(p) not in seen]
            if not deferred:
                check_not_meta(named, type(module).__name__, _LOAD_FIRST)
            sizes = [(name, p.numel() * p.element_size()) for name, p in named]
            names_seen += [name for name, _ in sizes]
            taken = set(
                select_within_budget(
                    sizes, self.cpu_offload_max_bytes, used, self.cpu_offload_params
                )
            )
            used += sum(size for name, size in sizes if name in taken)
            seen.update(id(p) for n, p in named if n in taken)
            eligible_bytes += sum(
                size for name, size in sizes if _eligible(name, self.cpu_offload_params)
            )
            params = [(n, p) for n, p in named if n in taken]
            plan.append(_Chosen(module, self.ledger.module_name(module, index), params))
        self._check_segments(names_seen)
        return plan, eligible_bytes

    def _check_segments(self, names: list[str]) -> None:
        if not self.cpu_offload_params:
            return
        missing = warn_unmatched_segments("cpu_offload_params", names, self.cpu_offload_params)
        if missing == self.cpu_offload_params:
            example = names[0] if names else "(the modules have no parameters)"
            raise ModelError(
                f"cpu_offload_params {sorted(missing)} match no parameter of the wrapped "
                f"modules; names are matched by whole dot-separated segments, e.g. {example!r}"
            )

    def _entries(self, part: _Chosen, pinned: bool | None) -> list[OffloadedParam]:
        """Manifest entries of `part`, its slab pinned or not (None: as planned)."""
        device = self._device_of(part)
        if pinned is None:
            pinned = should_pin_memory(device, self.disable_pin_memory)
        zero_copy = zero_copy_available(device, pinned, self.disable_uva)
        access = "zero-copy" if zero_copy else "copy-per-forward"
        location = OffloadedParam.location_of(pinned)
        return [OffloadedParam.of(part.name, n, p, location, access) for n, p in part.params]

    def _device_of(self, part: _Chosen) -> torch.device:
        return self.device or part.params[0][1].device

    # -- doing --

    def wrap_modules(
        self,
        modules: Iterable[nn.Module],
        submodule_accessor: object = None,
        whitelist_param_names_creator: object = None,
        *,
        deferred: bool = False,
    ) -> list[nn.Module]:
        """Offload parameters of `modules` in order until the budget is reached. The two
        extra arguments exist for vLLM callers; as in vLLM, UVA ignores them."""
        modules = list(modules)
        if self.cpu_offload_max_bytes <= 0:
            return modules
        plan, eligible_bytes = self._plan(modules, deferred)
        self._eligible_bytes += eligible_bytes
        for part in plan:
            if part.params:
                self._offload(part)
            self._num_wrapped += 1
        return modules

    def _offload(self, part: _Chosen) -> None:
        device = self._device_of(part)
        slab = self.ledger.pack_into_slab(part.params, device)
        zero_copy = zero_copy_available(device, slab.is_pinned, self.disable_uva)
        for (_, param), host in zip(part.params, slab.views, strict=True):
            view = device_view(host, device) if zero_copy and device.type == "cuda" else host
            set_param_data(param, view)  # the old storage is freed here
        self.ledger.entries += self._entries(part, slab.is_pinned)
        if not zero_copy:
            mine = [p for p in part.module.parameters() if id(p) in self.ledger.host_views]
            hook = CopyOnForwardHook(mine, device, self._count_copy)
            self.ledger.hooks.append(hook.attach(part.module))

    @property
    def weights_in_place(self) -> bool:
        """Every offloaded parameter is read in place from its slab (no copy per forward)."""
        return not any(isinstance(hook, CopyOnForwardHook) for hook in self.ledger.hooks)

    def recover(self) -> None:
        for hook in self.ledger.hooks:
            if isinstance(hook, CopyOnForwardHook):
                hook.recover()

    def _count_copy(self, num_bytes: int) -> None:
        self.bytes_copied += num_bytes
        self.num_copies += 1

    def post_init(self) -> None:
        budget = self.cpu_offload_max_bytes
        if 0 < self._eligible_bytes < budget:
            asked, there = _distinct(budget / 1024**3, self._eligible_bytes / 1024**3)
            warnings.warn(
                f"cpu_offload_gb ({asked} GiB) is more than the "
                f"{there} GiB of offloadable parameters in the "
                "wrapped layers; all of them were offloaded",
                UserWarning,
                stacklevel=2,
            )

    @property
    def slabs(self) -> tuple[HostSlab, ...]:
        """The host slabs holding the offloaded parameters, one per wrapped module."""
        return tuple(self.ledger.slabs)

    def _still_offloaded(self) -> list[OffloadedParam]:
        """Entries whose parameter still reads its host slab (a zero-copy device view has
        the slab's address): `model.to()` or an assignment makes a parameter resident."""
        still, moved = [], []
        for entry, (param, _) in zip(self.ledger.entries, self.ledger.taken, strict=True):
            same = param.data_ptr() == self.ledger.host_views[id(param)].data_ptr()
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

    def stats(self) -> OffloadStats:
        copies = CopyStats(bytes_copied=self.bytes_copied, num_copies=self.num_copies)
        return replace(super().stats(), copies=copies)


def _eligible(name: str, segments: set[str]) -> bool:
    return not segments or matches_segments(name, segments)


_LOAD_FIRST = "; load real weights before offloading"


def _distinct(larger: float, smaller: float) -> tuple[str, str]:
    """Two sizes with as few digits as tell them apart (3 at least, 9 at most)."""
    for digits in range(3, 10):
        shown = f"{larger:.{digits}g}", f"{smaller:.{digits}g}"
        if shown[0] != shown[1]:
            break
    return shown
