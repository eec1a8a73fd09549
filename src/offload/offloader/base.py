"""The offloader contract (vLLM's `BaseOffloader`), the no-op offloader, and the factory."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from offload.errors import ConfigError, ModelError
from offload.memory.copy_engine import capture
from offload.memory.host import HostSlab, TensorSpec, should_pin_memory
from offload.memory.placement import DiskIO, Placement
from offload.offloader.forward_lock import ForwardLock, ForwardLockHooks
from offload.offloader.selection import unmatched_segments


@dataclass(frozen=True)
class OffloadedParam:
    """One entry of an offloader's manifest: a parameter it moved off the device."""

    name: str  # qualified name in the model, e.g. "model.layers.3.mlp.up_proj.weight"
    module: str  # the wrapped module it belongs to, e.g. "model.layers.3"
    num_bytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    location: Placement  # now: HOST_PINNED or HOST (a host slab), or DISK (its file)
    access: str  # how compute reaches them: "zero-copy", "copy-per-forward" or "prefetch"

    @staticmethod
    def location_of(pinned: bool) -> Placement:
        return Placement.HOST_PINNED if pinned else Placement.HOST

    @classmethod
    def of(
        cls, module: str, name: str, tensor: torch.Tensor, location: Placement, access: str
    ) -> OffloadedParam:
        return cls(
            name=f"{module}.{name}",
            module=module,
            num_bytes=tensor.numel() * tensor.element_size(),
            shape=tuple(tensor.shape),
            dtype=tensor.dtype,
            location=location,
            access=access,
        )


def set_param_data(param: nn.Parameter, data: torch.Tensor) -> None:
    """Point `param` at `data`, keeping the Parameter object (ties and references
    survive). A meta parameter is swapped whole: its data cannot be set across types."""
    if param.is_meta and not data.is_meta:
        torch.utils.swap_tensors(param, nn.Parameter(data, requires_grad=param.requires_grad))
    else:
        param.data = data


class BaseOffloader(ABC):
    """Decides where parameters live and brings them in when layers run.

    The vLLM contract: `wrap_modules` takes the layer modules (a generator or any
    iterable) and returns them as a list, hooked or with parameters moved;
    `post_init` runs once the whole model is built; `sync_prev_onload` and
    `join_after_forward` bracket CUDA-graph capture and replay. Beyond vLLM, every
    offloader plans before it acts (`plan`: what would move, touching nothing; a dry run
    is the plan alone) and reports what it did: `offloaded_bytes`, `manifest()` and
    `stats()`.
    """

    def __init__(self, *, disable_pin_memory: bool = False) -> None:
        self.disable_pin_memory = disable_pin_memory
        self._manifest: list[OffloadedParam] = []
        self._slabs: list[HostSlab] = []  # the host memory holding offloaded parameters
        self._module_names: dict[int, str] = {}
        self._resident_param_ids: set[int] = set()
        self._host_views: dict[int, torch.Tensor] = {}
        self._on_disk: set[int] = set()  # taken parameters whose bytes stay in a file
        # (parameter, the device it was on) for each parameter taken, to undo a failed apply
        self._taken: list[tuple[nn.Parameter, torch.device]] = []
        self._hooks: list[Any] = []  # attached hooks (each has detach())
        # One forward at a time through the wrapped model (see `forward_lock.py`).
        self.forward_lock = ForwardLock(on_abandoned=self.recover)

    @abstractmethod
    def wrap_modules(
        self, modules: Iterable[nn.Module], *, deferred: bool = False
    ) -> list[nn.Module]:
        """Offload (some of) the parameters of `modules`, in order, as `plan` decides;
        return them. With `deferred`, parameters may still be on the meta device: they
        get their host memory, and a loader reads the checkpoint into it."""

    def plan(self, modules: Iterable[nn.Module]) -> list[OffloadedParam]:
        """The parameters of `modules` that `wrap_modules` would offload, decided without
        allocating, moving or attaching anything (`modules` may be on the meta device)."""
        raise NotImplementedError(f"{type(self).__name__} does not plan")

    @property
    def planned_staging_bytes(self) -> int:
        """Device memory the offloader needs beside the resident weights, known once it
        has planned (before `post_init`): the prefetch slots; none for the others."""
        return 0

    def post_init(self) -> None:  # noqa: B027 - a no-op default, as in vLLM
        """Called once after the model is built and wrapped."""

    def sync_prev_onload(self) -> None:  # noqa: B027
        """Make the compute stream wait for copies issued before this point."""

    def join_after_forward(self) -> None:  # noqa: B027
        """Join side streams back into the compute stream at the end of a forward."""

    def recover(self) -> None:  # noqa: B027
        """Drop what a forward that never finished (Ctrl-C, an ended thread) left
        half-done, so the next forward runs as on a fresh model."""

    def close(self) -> None:  # noqa: B027
        """Wait for copies in flight and end the offloader's threads. The model still
        runs afterwards only where no thread is needed (nothing for the no-op and UVA
        offloaders); host memory is freed with the last reference to the model."""

    def serialize_forwards(self, root: nn.Module) -> None:
        """Let one forward of `root` (the offloaded model) run at a time: calls from
        other threads wait for it (see `forward_lock.py`)."""
        hooks = ForwardLockHooks(self.forward_lock, self.forward_started, self.forward_finished)
        self._hooks.append(hooks.attach(root))

    def forward_started(self) -> None:  # noqa: B027
        """Called as a forward of the offloaded model begins (not a nested one), under
        the forward lock."""

    def forward_finished(self) -> None:  # noqa: B027
        """Called as that forward ends, still under the lock (a Ctrl-C may skip it:
        `recover` then undoes what `forward_started` did)."""

    @contextlib.contextmanager
    def graph_capture(self, graph: Any = None, **graph_kwargs: Any) -> Iterator[None]:
        """Capture a forward into `graph` (a `torch.cuda.CUDAGraph`) with the offloader's
        copies inside it, or, without a graph, bracket an eager forward or a replay.

        Everything vLLM spreads over its runner happens here: compute first waits for
        copies issued before (outside the capture, where that is allowed), and the copy
        stream is joined back before the capture ends, so the graph owns the forward's
        copies (also the prefetches for the next forward) and replays them.
        """
        self.sync_prev_onload()
        if graph is None:
            yield
            self.join_after_forward()
            return
        with capture(graph, **graph_kwargs):
            yield
            self.join_after_forward()

    def name_modules(self, root: nn.Module) -> None:
        """Learn qualified module names from `root`, so the manifest names parameters
        as `root.named_parameters()` does."""
        self._module_names = {id(module): name for name, module in root.named_modules()}

    def keep_resident(self, params: Iterable[nn.Parameter]) -> None:
        """Never offload these parameters (for instance, weights tied to modules
        outside the wrapped layers)."""
        self._resident_param_ids.update(id(p) for p in params)

    def module_name(self, module: nn.Module, index: int) -> str:
        return self._module_names.get(id(module), f"wrapped.{index}")

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of parameters that no longer occupy device memory."""
        return sum(entry.num_bytes for entry in self._still_offloaded())

    def _still_offloaded(self) -> list[OffloadedParam]:
        """The manifest entries whose parameters are still offloaded now."""
        return self._manifest

    def manifest(self) -> list[OffloadedParam]:
        """Every parameter this offloader moved, in the order it moved them."""
        return list(self._manifest)

    def is_offloaded(self, param: torch.Tensor) -> bool:
        return id(param) in self._host_views or id(param) in self._on_disk

    @property
    def disk_io(self) -> DiskIO | None:
        """How weights on disk are brought in (a disk tier's `disk_io`, AUTO resolved),
        or None: no weight streams from disk."""
        return None

    def on_disk(self, param: torch.Tensor) -> bool:
        """Whether an offloaded parameter's bytes stay in the checkpoint's file."""
        return id(param) in self._on_disk

    def _take(self, param: nn.Parameter, host: torch.Tensor | None) -> None:
        """Record that `param`'s bytes now live in `host` (this offloader owns it), or,
        without a host tensor, in the checkpoint's file on disk."""
        if host is None:
            self._on_disk.add(id(param))
            if not param.is_meta:  # its memory is freed now; a backend points it elsewhere
                empty = nn.Parameter(torch.empty_like(param, device="meta"), param.requires_grad)
                torch.utils.swap_tensors(param, empty)
        else:
            self._host_views[id(param)] = host
        self._taken.append((param, param.device))
        param._offload_taken = True  # (an attribute: it survives swap_tensors, no weakref)

    def _pack_into_slab(
        self, named: list[tuple[str, nn.Parameter]], device: torch.device
    ) -> HostSlab:
        """One exact-size host slab for `named` (pinned where a CUDA device reads it),
        holding their values, each parameter taken (see `_take`). Their data is left as
        it is: each backend points them where compute reads them."""
        pin = should_pin_memory(device, self.disable_pin_memory)
        slab = HostSlab([TensorSpec.of(p) for _, p in named], pin_for=device if pin else None)
        for (_, param), host in zip(named, slab.views, strict=True):
            if not param.is_meta:  # (meta: a loader will read the checkpoint into `host`)
                host.copy_(param.data)
            self._take(param, host)
        self._slabs.append(slab)
        return slab

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes held (exact slab sizes rounded to whole pages)."""
        return sum(slab.mapped_bytes for slab in self._slabs if slab.is_pinned)

    @property
    def host_bytes(self) -> int:
        """All host bytes held for offloaded parameters, pinned or not."""
        return sum(slab.mapped_bytes for slab in self._slabs)

    def undo(self) -> None:
        """Give back everything taken so far (after a failed `apply`): hooks detached,
        each parameter's values back on the device it came from."""
        for hook in self._hooks:
            hook.detach()
        self._hooks = []
        for param, device in reversed(self._taken):
            param._offload_taken = False
            if id(param) in self._on_disk:  # its bytes are in the checkpoint: read them back
                self._on_disk.discard(id(param))
                if device.type != "meta":
                    set_param_data(param, self._restore(param).to(device))
                continue
            host = self._host_views.pop(id(param))
            if not param.is_meta and device.type != "meta":  # (meta: never had values)
                param.data = host if device.type == "cpu" else host.to(device)
        self._taken = []
        self._manifest = []

    def _restore(self, param: nn.Parameter) -> torch.Tensor:
        """The value of a taken parameter that has no host copy (see `_take`)."""
        raise KeyError("no host copy of an offloaded parameter")

    def saved_value(self, param: torch.Tensor) -> torch.Tensor:
        """An offloaded parameter's true value: its host copy, or read from where it is."""
        host = self.host_view(param)
        return host if host is not None else self._restore(param)

    def host_tensor(self, name: str) -> torch.Tensor:
        """The host copy of an offloaded parameter (by its manifest name)."""
        for entry, (param, _) in zip(self._manifest, self._taken, strict=True):
            if entry.name == name:
                host = self._host_views.get(id(param))
                return host if host is not None else self._restore(param)
        raise KeyError(name)

    def host_view(self, param: torch.Tensor) -> torch.Tensor | None:
        """Where an offloaded parameter's bytes live on the host (a loader writes there);
        None for a parameter this offloader did not take."""
        return self._host_views.get(id(param))

    def stats(self) -> dict[str, Any]:
        """Counters for what was offloaded and what has moved since."""
        still = self._still_offloaded()
        return {
            "offloaded_bytes": sum(entry.num_bytes for entry in still),
            "num_offloaded_params": len(still),
        }


class NoopOffloader(BaseOffloader):
    """Offloads nothing: every parameter stays where it is."""

    def wrap_modules(
        self, modules: Iterable[nn.Module], *, deferred: bool = False
    ) -> list[nn.Module]:
        return list(modules)

    def plan(self, modules: Iterable[nn.Module]) -> list[OffloadedParam]:
        return []


def check_not_meta(named: Iterable[tuple[str, nn.Parameter]], where: str, advice: str = "") -> None:
    """Refuse parameters still on the meta device (unless loading is deferred, when a
    loader fills them in)."""
    for name, param in named:
        if param.is_meta:
            raise ModelError(f"parameter {name!r} of {where} is on the meta device{advice}")


def warn_unmatched_segments(option: str, names: list[str], segments: set[str]) -> set[str]:
    """The `segments` of `option` that match none of `names`; a warning names them when
    the others are used."""
    missing = unmatched_segments(names, segments)
    if missing and len(missing) < len(segments):
        warnings.warn(
            f"{option} {sorted(missing)} match no parameter; the others are used",
            UserWarning,
            stacklevel=4,
        )
    return missing


_NOOP = NoopOffloader()
# The process-wide offloader: held strongly when a caller sets one (vLLM's way), weakly
# when `offload.apply` does, so that a model nobody references any more is freed with
# its offloader, its threads and its host memory.
_instance: BaseOffloader | weakref.ref[BaseOffloader] = _NOOP


def offloaded_params(model: nn.Module) -> list[str]:
    """Names of `model`'s parameters that an offloader has already taken."""
    return [
        name
        for name, p in model.named_parameters(remove_duplicate=False)
        if getattr(p, "_offload_taken", False)
    ]


def get_offloader() -> BaseOffloader:
    """The process-wide offloader (what custom ops and vLLM-style callers use); the
    no-op offloader once the model `offload.apply` set it for is gone."""
    if isinstance(_instance, weakref.ref):
        return _instance() or _NOOP
    return _instance


def set_offloader(instance: BaseOffloader, *, weak: bool = False) -> None:
    """Replace the process-wide offloader. With `weak`, it is not kept alive by being
    the process-wide one (what `offload.apply` does)."""
    global _instance
    if not isinstance(instance, BaseOffloader):
        raise ConfigError(f"set_offloader needs a BaseOffloader, got {type(instance).__name__}")
    _instance = weakref.ref(instance) if weak else instance
