"""How bytes move host -> device, ordered against compute: a CUDA copy stream with events,
or, with the CPU as the compute device, a worker thread with the same protocol.

The protocol, seen from the offloader:
  - `mark_released()` on the compute side returns a marker for "every read issued so far";
  - `copy(dst, src, after=marker)` starts a copy that first waits for that marker
    (the slot it overwrites is no longer read) and returns a ticket;
  - `wait(ticket)` makes compute wait until the copy landed.
Nothing here blocks the host on CUDA: the waits are stream waits.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from offload.memory.threads import advise_passive_wait_policy, available_cores


@dataclass
class CopyStats:
    """Counters kept by a copy engine (cheap enough to leave on)."""

    bytes_copied: int = 0
    num_copies: int = 0
    copy_s: float = 0.0  # time the copy engine spent copying
    stall_s: float = 0.0  # time compute waited for a copy that had not landed
    num_stalls: int = 0

    @property
    def achieved_gb_per_s(self) -> float:
        return self.bytes_copied / self.copy_s / 1e9 if self.copy_s > 0 else 0.0

    def snapshot(self) -> CopyStats:
        """A copy that later copies leave unchanged."""
        return dataclasses.replace(self)


class CopyEngine(ABC):
    """Moves whole byte ranges from host to the compute device, off the compute path."""

    def __init__(self) -> None:
        self.stats = CopyStats()
        self.compute_busy = False  # set by the offloader around forwards

    @abstractmethod
    def mark_released(self) -> Any:
        """A marker for all compute issued so far (to order an overwrite after it)."""

    @abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> Any:
        """Start copying `src` (host, uint8) into `dst` (device, uint8) once `after` is
        reached; return a ticket to `wait` on."""

    @abstractmethod
    def wait(self, ticket: Any) -> None:
        """Make compute wait until the copy of `ticket` has landed."""

    @abstractmethod
    def synchronize(self) -> None:
        """Make compute wait for every copy started so far."""

    def host_wait(self, ticket: Any) -> None:
        """Block the calling thread (any thread) until the copy of `ticket` is done, so
        that its source may be overwritten."""
        if ticket is not None:
            ticket.result()

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Wait for the copies in flight and release what the engine holds (threads)."""

    def collect_stats(self) -> CopyStats:
        return self.stats


class ThreadCopyEngine(CopyEngine):
    """With the CPU as the compute device: one worker thread plays the copy stream.

    Copies are single `memmove`s that release the GIL, so they overlap compute on
    another core, in the order they were issued. Compute is synchronous on the CPU, so
    "released" is already true when a copy is queued; `wait` blocks the calling thread
    until the ticket's copy is done. `delay_s` (tests only) sleeps before each copy, to
    shake out ordering bugs.
    """

    # Copies timed during forwards before the spin check (see memory/threads.py).
    _CHECK_AFTER_COPIES = 64

    def __init__(self, delay_s: float = 0.0):
        super().__init__()
        # [bytes, seconds] of copies run while compute was idle / busy
        self._idle = [0, 0.0]
        self._busy = [0, 0.0]
        self._busy_copies = 0
        self._spin_checked = False
        # One worker: copies land in issue order. The executor joins it at exit.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-copy")
        self._delay_s = delay_s
        self._closed = False
        weakref.finalize(self, self._worker.shutdown, wait=False)

    def mark_released(self) -> None:
        return None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> Future:
        if dst.numel() != src.numel():
            raise ValueError(f"copy of {src.numel()} bytes into {dst.numel()} bytes")
        ticket = self._worker.submit(self._copy, dst, src)
        # Counted when issued, as the CUDA engine does (the time when it has run).
        self.stats.bytes_copied += dst.numel()
        self.stats.num_copies += 1
        return ticket

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._delay_s:
            time.sleep(self._delay_s)
        busy = self.compute_busy
        started = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.numel())
        seconds = time.perf_counter() - started
        self.stats.copy_s += seconds
        timed = self._busy if busy else self._idle
        timed[0] += dst.numel()
        timed[1] += seconds
        self._busy_copies += busy

    def wait(self, ticket: Future) -> None:
        if not ticket.done():
            started = time.perf_counter()
            ticket.result()
            self.stats.stall_s += time.perf_counter() - started
            self.stats.num_stalls += 1
        ticket.result()  # re-raises a failed copy here, on the compute thread
        if not self._spin_checked and self._busy_copies >= self._CHECK_AFTER_COPIES:
            self._spin_checked = True  # once: on the compute thread, with its thread count
            advise_passive_wait_policy(_rate(*self._idle), _rate(*self._busy))

    def synchronize(self) -> None:
        # Copies run in issue order: an empty task done means every copy before it is.
        # (Not a remembered last ticket: a Ctrl-C between a submit and its bookkeeping
        # would leave that one out.)
        if not self._closed:
            self._worker.submit(_nothing).result()

    def close(self) -> None:
        """Wait for the copies in flight, then end the worker thread."""
        self._closed = True
        self._worker.shutdown(wait=True)


def _nothing() -> None:
    return None


def _rate(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else 0.0


class CudaCopyEngine(CopyEngine):
    """A dedicated copy stream; ordering by events, never by host synchronisation.

    Timing events bracket each copy and each wait, and are read lazily in
    `collect_stats` (outside graph capture), so the hot path only records events.
    """

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._timed: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._joined_capture = False  # has the copy stream taken part in the current capture?

    def mark_released(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> _CudaTicket:
        capturing = torch.cuda.is_current_stream_capturing()
        self._joined_capture |= capturing
        with torch.cuda.stream(self.stream):
            if after is not None:
                # The copy stream waits until the layer that last read this slot is done.
                self.stream.wait_event(after)
            start = None if capturing else _timing_event(self.stream)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event(enable_timing=not capturing)
            done.record(self.stream)
        self.stats.bytes_copied += dst.numel()
        self.stats.num_copies += 1
        if start is not None:
            self._timed.append(("copy", start, done))
            self._drain(block=False)
        return _CudaTicket(done, _capture_number if capturing else None)

    def wait(self, ticket: _CudaTicket) -> None:
        compute = torch.cuda.current_stream(self.device)
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing and ticket.capture != _capture_number:
            # Issued before this capture began (eagerly, or inside an earlier capture that
            # its replays run in stream order): the capture starts after a device sync, and
            # an event from outside a capture cannot be waited on inside it.
            return
        if not capturing and ticket.capture is not None:
            # Copied inside a CUDA graph: its replays run on this stream, in order, so
            # the copy has landed; and an event recorded in a capture cannot be waited
            # on outside it (CUDA refuses it as an invalid argument).
            return
        before = None if capturing else _timing_event(compute)
        # The compute stream waits until the slot holds this layer's weights.
        compute.wait_event(ticket.event)
        if before is not None:
            self._timed.append(("stall", before, _timing_event(compute)))

    def host_wait(self, ticket: _CudaTicket) -> None:
        if ticket.capture is not None and not torch.cuda.is_current_stream_capturing():
            # (a captured event cannot be waited on: the replays run on the compute stream)
            torch.cuda.current_stream(self.device).synchronize()
            return
        ticket.event.synchronize()

    def synchronize(self) -> None:
        if torch.cuda.is_current_stream_capturing():
            # Join only a copy stream that is part of this capture: waiting inside a
            # capture on work recorded outside it is not allowed.
            if not self._joined_capture:
                return
            self._joined_capture = False
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def collect_stats(self) -> CopyStats:
        self._drain(block=True)
        return self.stats

    def _drain(self, block: bool) -> None:
        """Fold finished timing pairs into the counters; without `block`, only when many
        are pending and only those already done (never a host wait on the hot path)."""
        if not block and len(self._timed) < 1024:
            return
        pending = []
        for kind, start, end in self._timed:
            if not block and not end.query():
                pending.append((kind, start, end))
                continue
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
            if kind == "copy":
                self.stats.copy_s += seconds
            elif seconds > 1e-6:
                self.stats.stall_s += seconds
                self.stats.num_stalls += 1
        self._timed = pending


@dataclass(frozen=True)
class _CudaTicket:
    event: torch.cuda.Event
    capture: int | None  # the capture it was issued in (None: issued eagerly)


def _timing_event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


_capture_number = 0  # counts captures, so a ticket knows which capture it belongs to


@contextlib.contextmanager
def capture(graph: torch.cuda.CUDAGraph, **kwargs: Any) -> Iterator[None]:
    """The context that captures CUDA work into `graph` (torch's, with its keywords)."""
    global _capture_number
    _capture_number += 1
    with torch.cuda.graph(graph, **kwargs):
        yield


class SyncCopyEngine(CopyEngine):
    """With the CPU as the compute device and every core computing: each copy runs when
    it is issued, on the compute thread, spread over torch's threads.

    A copy thread would need a core that compute uses, and only fight compute for it:
    with every core computing, compute plus copy time (nothing overlapped) is the most
    the cores allow, and copies on the compute threads reach it. Taking a core from
    compute instead changes float results: a matrix product on fewer threads sums in
    another order, and offloading must not change a bit. Copies land in issue order, so
    the protocol holds trivially. The figures are in docs/benchmarks.md ("The CPU")."""

    def mark_released(self) -> None:
        return None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> None:
        if dst.numel() != src.numel():
            raise ValueError(f"copy of {src.numel()} bytes into {dst.numel()} bytes")
        started = time.perf_counter()
        dst.copy_(src)
        self.stats.copy_s += time.perf_counter() - started
        self.stats.bytes_copied += dst.numel()
        self.stats.num_copies += 1

    def wait(self, ticket: None) -> None:
        return None

    def synchronize(self) -> None:
        return None


def make_copy_engine(device: torch.device, delay_s: float = 0.0) -> CopyEngine:
    """The copy engine for `device`: a CUDA copy stream; on the CPU, a worker thread when
    torch computes on fewer threads than there are cores (one is free to copy), else
    copies on the compute thread (`delay_s`, for tests, always means the worker)."""
    if device.type == "cuda":
        return CudaCopyEngine(device)
    if device.type == "cpu":
        if delay_s or torch.get_num_threads() < available_cores():
            return ThreadCopyEngine(delay_s)
        return SyncCopyEngine()
    raise ValueError(f"prefetch offloading supports cpu and cuda devices, got {device}")
