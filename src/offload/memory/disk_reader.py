"""Byte ranges of checkpoint files read into host buffers on I/O threads, beside compute.

A layer kept on disk is a list of `Extent`s (see `disk_layout.py`). `DiskReader` runs the reads on its own threads (`os.preadv` releases the GIL) and hands
back a ticket to wait on, as a copy engine does. Every file is checked against the size,
modification time and inode it had when the model was loaded, by descriptor and by path,
after each read: a file replaced, truncated, rewritten or removed while the model runs,
or a failing read, is a `DiskReadError` naming the file, raised where the ticket is
waited for. The first fault ends the reader's threads; every later read raises it, until
`invalidate` (the offloader forgetting its slots after the failed forward) finds it was
an I/O error on an unchanged file: then the reader starts again, and a read that still
fails fails again.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from offload.errors import ModelError
from offload.memory.disk_layout import ALIGN, Extent, Move, PendingMoves
from offload.memory.file_stamp import DiskReadError, FileStamp
from offload.memory.placement import READ_MODES, DiskIO

# The least bytes of one read request. A layer's reads are split into one request per
# thread (each at least this): on a CPU whose cores compute beside the reads, each request
# waits for its I/O thread to be run again, and beside matrix products on both cores a
# layer read in many small requests read slower than in a few large ones
# (benchmarks/gguf_convert.py --compare; docs/benchmarks.md, "A .gguf as stored at a size
# where memory shows (issue 47, 2026-11-28)").
CHUNK_BYTES = 4 * 2**20


@dataclass
class ReadStats:
    """Counters kept by a reader."""

    bytes_read: int = 0
    num_reads: int = 0
    busy_s: float = 0.0  # wall time with at least one read in flight
    stall_s: float = 0.0  # time compute waited for a read that had not landed
    num_stalls: int = 0

    @property
    def read_gb_per_s(self) -> float:
        return self.bytes_read / self.busy_s / 1e9 if self.busy_s > 0 else 0.0


class ReadTicket:
    """The reads of one layer: done when all its chunks are."""

    def __init__(self, futures: list[Future]):
        self.futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self.futures)


class DiskReader:
    """Reads extents into host buffers on `num_threads` I/O threads.

    `DiskIO.DIRECT` opens files with `O_DIRECT` (falling back to buffered reads where the
    file system refuses it) and, for buffered reads, drops the pages it read from the
    page cache, so streamed weights do not pile up there; `DiskIO.PAGE_CACHE` reads
    through the page cache and leaves the pages (a warm cache serves the next pass).
    `delay_s` (tests only) sleeps before each read."""

    def __init__(
        self,
        stamps: Sequence[FileStamp],
        *,
        num_threads: int = 2,
        io: DiskIO = DiskIO.DIRECT,
        chunk_bytes: int = CHUNK_BYTES,  # the least bytes of a request
        delay_s: float = 0.0,
    ):
        if io not in READ_MODES:
            raise ModelError(f"disk io must be one of {', '.join(READ_MODES)}, got {io!r}")
        self.io = DiskIO(io)
        self.stats = ReadStats()
        self._stamps = {stamp.path: stamp for stamp in stamps}
        self._chunk_bytes = chunk_bytes
        self._delay_s = delay_s
        self._fds: dict[Path, tuple[int, bool]] = {}  # path -> (descriptor, is direct)
        self._lock = threading.Lock()
        self._in_flight = 0
        self._busy_since = 0.0
        self._fault: DiskReadError | None = None
        # Per buffer (its storage address): the generation of its latest read, and the
        # chunks writing into it now, by generation. A chunk writes only if its read is
        # still the buffer's latest, once older chunks already writing are done: so a
        # read abandoned by a Ctrl-C, or forgotten by `invalidate`, never lands late.
        self._generation: dict[int, int] = {}
        self._writing: dict[int, dict[int, int]] = {}
        self._buffers = threading.Condition()
        self._num_threads = num_threads
        self._pools = [self._new_pool()]  # the last one reads; a list, for the finalizer
        # A reader dropped without close() still ends its threads and closes its files.
        weakref.finalize(self, _drop, self._pools, self._fds, self._lock)

    @property
    def _pool(self) -> ThreadPoolExecutor:
        return self._pools[-1]

    def _new_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=self._num_threads, thread_name_prefix="offload-io")

    def read(
        self,
        buffer: torch.Tensor,
        extents: Sequence[Extent],
        after: Callable[[], None] | None = None,
        moves: Sequence[Move] = (),
    ) -> ReadTicket:
        """Start reading `extents` into `buffer` (contiguous uint8 host memory); `after`
        runs on the I/O thread before each read (e.g. waits until the buffer is free);
        `moves` run in order, on the I/O thread of the last read to land."""
        self._raise_fault()
        ends = [e.buffer_offset + e.num_bytes for e in extents]
        ends += [max(m.source, m.target) + m.num_bytes for m in moves]
        if any(end > buffer.numel() for end in ends):
            raise ValueError(f"extents or moves run past their {buffer.numel()}-byte buffer")
        key = buffer.untyped_storage().data_ptr()
        with self._buffers:
            generation = self._generation[key] = self._generation.get(key, 0) + 1
        ticket = ReadTicket([])
        chunk_bytes = self._request_bytes(extents)
        num_chunks = sum(-(-e.num_bytes // chunk_bytes) for e in extents)
        last = PendingMoves(buffer.data_ptr(), tuple(moves), num_chunks) if moves else None
        for extent in extents:
            for done in range(0, extent.num_bytes, chunk_bytes):
                size = min(chunk_bytes, extent.num_bytes - done)
                target = buffer[extent.buffer_offset + done : extent.buffer_offset + done + size]
                owner = (key, generation)
                job = (extent.path, extent.file_offset + done, target, owner, after, last)
                try:
                    ticket.futures.append(self._pool.submit(self._read_chunk, *job))
                except RuntimeError:  # an earlier chunk failed and ended the threads
                    self._raise_fault()
                    raise
        return ticket

    def _request_bytes(self, extents: Sequence[Extent]) -> int:
        """The size of each request of one read: its bytes split over the threads, in
        whole blocks (`O_DIRECT`), and never under `chunk_bytes`."""
        total = sum(extent.num_bytes for extent in extents)
        share = -(-total // self._num_threads)
        return max(self._chunk_bytes, -(-share // ALIGN) * ALIGN)

    def wait(self, ticket: ReadTicket, *, count_stall: bool = True) -> None:
        """Block until `ticket`'s reads have landed; raise the fault of any of them.
        (`count_stall`: the wait holds up compute, so it counts as a stall.)"""
        if not ticket.done() and count_stall:
            started = time.perf_counter()
            _settle(ticket.futures)
            self.stats.stall_s += time.perf_counter() - started
            self.stats.num_stalls += 1
        for future in ticket.futures:
            try:
                error = future.exception()
            except CancelledError:  # cancelled as the first fault ended the threads
                error = self._fault or DiskReadError("a read was cancelled")
            if error is not None:
                raise error if isinstance(error, DiskReadError) else self._fail(error)

    def invalidate(self) -> None:
        """Forget every read issued so far: none writes into its buffer after this returns
        (those writing now are waited for, those not started yet skip). Their tickets
        then say nothing of the buffers: load them again."""
        with self._buffers:
            for key in self._generation:
                self._generation[key] += 1
            while any(any(per.values()) for per in self._writing.values()):
                self._buffers.wait()
        self._restart_after_transient_fault()

    @property
    def failed_transiently(self) -> bool:
        """A read failed on a file still as loaded (an I/O error): `invalidate` restarts."""
        fault = self._fault
        return fault is not None and fault.transient

    def _restart_after_transient_fault(self) -> None:
        """After a failed read of an unchanged file, read again (new threads): nothing
        read before counts, the slots are all loaded again."""
        with self._lock:
            if self._fault is None or not self._fault.transient:
                return
        self._pool.shutdown(wait=True)
        with self._lock:
            self._pools[:] = [self._new_pool()]
            self._fault = None

    def close(self) -> None:
        """Wait for reads in flight, end the threads and close the files (a reader that
        is dropped unclosed does the same, without waiting)."""
        self._pool.shutdown(wait=True)
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def _raise_fault(self) -> None:
        if self._fault is not None:
            raise DiskReadError(str(self._fault))

    def _fail(self, error: BaseException) -> DiskReadError:
        fault = error if isinstance(error, DiskReadError) else DiskReadError(str(error))
        with self._lock:
            if self._fault is None:
                self._fault = fault
        self._pool.shutdown(wait=False, cancel_futures=True)  # the I/O threads end
        return fault

    def _read_chunk(
        self,
        path: Path,
        offset: int,
        target: torch.Tensor,
        owner: tuple[int, int],
        after: Callable[[], None] | None,
        moves: PendingMoves | None = None,
    ) -> None:
        try:
            if self._fault is not None:
                raise DiskReadError(str(self._fault))
            if after is not None:
                after()
            if self._delay_s:
                time.sleep(self._delay_s)
            if not self._start_writing(*owner):
                return  # a later read owns the buffer now
            self._begin()
            try:
                self._pread(path, offset, target)
                if moves is not None:
                    moves.landed()  # (the last read's thread moves, before it stops writing)
            finally:
                self._end(target.numel())
                self._stop_writing(*owner)
        except DiskReadError as error:
            raise self._fail(error) from None
        except OSError as error:
            reason = error.strerror or str(error)
            failed = DiskReadError(f"reading {path} failed: {reason}", transient=True)
            raise self._fail(failed) from None

    def _start_writing(self, key: int, generation: int) -> bool:
        """Wait until chunks of older reads writing into the buffer are done; then write
        only if this read is still the buffer's latest."""
        with self._buffers:
            writing = self._writing.setdefault(key, {})
            while any(n for g, n in writing.items() if g < generation):
                self._buffers.wait()
            if self._generation.get(key) != generation:
                return False
            writing[generation] = writing.get(generation, 0) + 1
            return True

    def _stop_writing(self, key: int, generation: int) -> None:
        with self._buffers:
            self._writing[key][generation] -= 1
            if not self._writing[key][generation]:
                del self._writing[key][generation]
            self._buffers.notify_all()

    def _pread(self, path: Path, offset: int, target: torch.Tensor) -> None:
        stamp = self._stamps[path]
        fd, direct = self._descriptor(path)
        direct = direct and target.data_ptr() % ALIGN == 0 and target.numel() % ALIGN == 0
        expected = max(0, min(target.numel(), stamp.size - offset))
        view = memoryview(target.numpy()).cast("B")
        # An unaligned piece of a file opened for O_DIRECT needs a buffered descriptor.
        source = fd if direct or not self._fds[path][1] else self._buffered(path)
        # O_DIRECT asks for whole blocks and gets a short read at the end of the file.
        limit = target.numel() if source == fd and direct else expected
        done = 0
        while done < expected:
            count = os.preadv(source, [view[done:limit]], offset + done)
            if count == 0:
                break
            done += count
        self._check(path, fd)
        if done < expected:
            raise DiskReadError(
                f"{path} is truncated: a read at byte {offset + done} came back short"
            )
        if self.io == DiskIO.DIRECT and not direct:  # keep streamed pages out of the page cache
            os.posix_fadvise(source, offset, expected, os.POSIX_FADV_DONTNEED)

    def _check(self, path: Path, fd: int) -> None:
        """The file, by descriptor and by name, is still the one loaded."""
        stamp = self._stamps[path]
        problem = stamp.differs(os.fstat(fd))
        if problem is None:
            try:
                problem = stamp.differs(os.stat(path))
            except FileNotFoundError:
                problem = "was removed"
        if problem is not None:
            raise DiskReadError(
                f"{path} {problem} while the model was running; weights stream from it: "
                "reload the model after changing its files"
            )

    def _descriptor(self, path: Path) -> tuple[int, bool]:
        with self._lock:
            if path not in self._fds:
                self._fds[path] = self._open(path)
            return self._fds[path]

    def _buffered(self, path: Path) -> int:
        key = Path(f"{path}\0buffered")  # a second, buffered descriptor of the same file
        with self._lock:
            if key not in self._fds:
                self._fds[key] = (os.open(path, os.O_RDONLY), False)
            return self._fds[key][0]

    def _open(self, path: Path) -> tuple[int, bool]:
        if self.io == DiskIO.DIRECT and hasattr(os, "O_DIRECT"):
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT), True
            except OSError as error:
                if error.errno != errno.EINVAL:  # EINVAL: no O_DIRECT on this file system
                    raise
        return os.open(path, os.O_RDONLY), False

    def _begin(self) -> None:
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = time.perf_counter()
            self._in_flight += 1

    def _end(self, num_bytes: int) -> None:
        with self._lock:
            self._in_flight -= 1
            self.stats.bytes_read += num_bytes
            self.stats.num_reads += 1
            if self._in_flight == 0:
                self.stats.busy_s += time.perf_counter() - self._busy_since


def _settle(futures: list[Future]) -> None:
    """Wait until each of `futures` has finished or was cancelled. (Not
    `concurrent.futures.wait`: a future cancelled by `shutdown(cancel_futures=True)` never
    counts as done there, and the wait would never end.)"""
    for future in futures:
        with contextlib.suppress(CancelledError):
            future.exception()


def _drop(pools: list[ThreadPoolExecutor], fds: dict[Path, tuple[int, bool]], lock: threading.Lock):
    """A reader no longer referenced: its threads end and its files close."""
    for pool in pools:
        pool.shutdown(wait=False, cancel_futures=True)
    with lock:
        for fd, _ in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        fds.clear()
