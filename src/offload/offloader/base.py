"""The offloader contract (vLLM's `BaseOffloader`: `wrap_modules`, and no-op defaults for
the rest), the no-op offloader, and the process-wide offloader. What an offloader took and
where it keeps it is its `Ledger` (`ledger.py`)."""

from __future__ import annotations

import contextlib
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from offload.errors import ConfigError
from offload.memory.copy_engine import capture
from offload.memory.placement import DiskIO
from offload.offloader.forward_lock import ForwardLock, ForwardLockHooks
from offload.offloader.ledger import Ledger
from offload.offloader.manifest import OffloadedParam
from offload.offloader.stats import OffloadStats


class BaseOffloader(ABC):
    """Decides where parameters live and brings them in when layers run.

    The vLLM contract: `wrap_modules` takes the layer modules (a generator or any
    iterable) and returns them as a list, hooked or with parameters moved;
    `post_init` runs once the whole model is built; `sync_prev_onload` and
    `join_after_forward` bracket CUDA-graph capture and replay. Beyond vLLM, every
    offloader plans before it acts (`plan`: what would move, touching nothing; a dry run
    is the plan alone) and reports what it did: `offloaded_bytes`, `manifest()` and
    `stats()`; its `ledger` keeps what it took, and undoes it.
    """

    def __init__(self, *, disable_pin_memory: bool = False) -> None:
        self.disable_pin_memory = disable_pin_memory
        self.ledger = Ledger(disable_pin_memory=disable_pin_memory)
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
        self.ledger.hooks.append(hooks.attach(root))

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

    @property
    def disk_io(self) -> DiskIO | None:
        """How weights on disk are brought in (a disk tier's `disk_io`, AUTO resolved),
        or None: no weight streams from disk."""
        return None

    @property
    def weights_in_place(self) -> bool:
        """Whether every parameter stays the same tensor at the same place from one
        forward to the next (nothing copied in, swapped or read for a forward): then what
        a compiled CPU step's guards found true at a decode loop's first step holds at
        its later ones (`engine/cpu_step.py`). False unless the offloader knows it."""
        return False

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of parameters that no longer occupy device memory."""
        return sum(entry.num_bytes for entry in self._still_offloaded())

    def _still_offloaded(self) -> list[OffloadedParam]:
        """The manifest entries whose parameters are still offloaded now."""
        return self.ledger.entries

    @property
    def host_bytes(self) -> int:
        """All host bytes held for offloaded parameters, pinned or not."""
        return self.ledger.host_bytes

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes held (exact slab sizes rounded to whole pages)."""
        return self.ledger.pinned_bytes

    def manifest(self) -> list[OffloadedParam]:
        """Every parameter this offloader moved, in the order it moved them."""
        return list(self.ledger.entries)

    def restore(self, param: nn.Parameter) -> torch.Tensor:
        """The value of a taken parameter that has no host copy (its file's bytes)."""
        raise KeyError("no host copy of an offloaded parameter")

    def stats(self) -> OffloadStats:
        """What is offloaded and held now, and what has moved since."""
        still = self._still_offloaded()
        return OffloadStats(
            offloaded_bytes=sum(entry.num_bytes for entry in still),
            num_offloaded_params=len(still),
            host_bytes=self.ledger.host_bytes,
            pinned_bytes=self.ledger.pinned_bytes,
        )


class NoopOffloader(BaseOffloader):
    """Offloads nothing: every parameter stays where it is."""

    weights_in_place = True

    def wrap_modules(
        self, modules: Iterable[nn.Module], *, deferred: bool = False
    ) -> list[nn.Module]:
        return list(modules)

    def plan(self, modules: Iterable[nn.Module]) -> list[OffloadedParam]:
        return []


_NOOP = NoopOffloader()
# The process-wide offloader: held strongly when a caller sets one (vLLM's way), weakly
# when `offload.apply` does, so that a model nobody references any more is freed with
# its offloader, its threads and its host memory.
_instance: BaseOffloader | weakref.ref[BaseOffloader] = _NOOP


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
