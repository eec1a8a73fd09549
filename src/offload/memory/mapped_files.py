"""Checkpoint files mapped into memory, so that compute on the CPU reads streamed weights
straight from the page cache (no copy), guarded so that a file changed under the model
is an error, never a crash and never a wrong answer.

A mapped file that someone truncates turns every read past its new end into SIGBUS, and
an in-place write changes the weights under a running forward. So each file holds a Linux
read lease while it is mapped: whoever opens it for writing or truncates it is held by the
kernel until the lease is given back (or `/proc/sys/fs/lease-break-time` passes). A watcher
thread sees a lease being broken, and a file replaced, removed or touched, within `POLL_S`;
from then on every forward is refused with a `DiskReadError` naming the file, and once no
forward runs the mappings are replaced by zero pages and the leases given back, so the
writer goes on and nothing can fault. Where a lease cannot be had (another owner, a file
open for writing, a file system without leases) the files are not mapped at all.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import signal
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from offload.errors import ModelError
from offload.memory.disk_layout import Extent
from offload.memory.disk_reader import DiskReadError, FileStamp

POLL_S = 0.02  # how often the watcher looks at the leases and the files
_F_SETSIG, _F_SETLEASE, _F_GETLEASE = 10, 1024, 1025  # Linux fcntl commands
# A lease break is signalled to its holder; SIGURG is ignored unless handled, and the
# watcher polls the lease instead (signals reach only Python's main thread).
_BREAK_SIGNAL = signal.SIGURG
_SAMPLED_PAGES = 3  # pages of a run looked at before hinting it (first, middle, last)


class MappingRefused(ModelError):
    """The checkpoint's files cannot be mapped safely (no lease on one of them)."""


class MappedFiles:
    """Read-only (copy-on-write) mappings of checkpoint files under read leases."""

    def __init__(self, stamps: Sequence[FileStamp]):
        self._stamps = {stamp.path: stamp for stamp in stamps}
        self._pid = os.getpid()  # the process whose leases these are
        self._fds: dict[Path, int] = {}
        self._maps: dict[Path, mmap.mmap] = {}
        self._bases: dict[Path, int] = {}  # each mapping's first byte (looked at per hint)
        self._lock = threading.Lock()
        self._active = False  # a forward may be reading the mappings
        self._fault: str | None = None
        self._released = False
        try:
            for stamp in stamps:
                self._map(stamp)
        except BaseException:
            self._release()
            raise
        self._stop = threading.Event()
        self._hints = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-hint")
        # The watcher holds these files weakly, so that a model dropped without close()
        # is collected; then the finalizer ends the threads and gives the leases back.
        self._watcher = threading.Thread(
            target=_watch, args=(weakref.ref(self), self._stop), name="offload-lease", daemon=True
        )
        self._finalizer = weakref.finalize(
            self, _drop, self._stop, self._hints, self._fds, self._pid
        )
        self._watcher.start()

    def _map(self, stamp: FileStamp) -> None:
        fd = os.open(stamp.path, os.O_RDONLY)
        self._fds[stamp.path] = fd
        try:
            fcntl.fcntl(fd, _F_SETSIG, _BREAK_SIGNAL)
            fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_RDLCK)
        except OSError as error:
            raise MappingRefused(
                f"cannot hold a read lease on {stamp.path} ({error.strerror or error}), "
                "so a change to it could crash a process that maps it"
            ) from None
        problem = stamp.differs(os.fstat(fd))
        if problem is not None:
            raise DiskReadError(f"{stamp.path} {problem} since the model was loaded")
        if stamp.size:
            self._maps[stamp.path] = mmap.mmap(fd, stamp.size, access=mmap.ACCESS_COPY)
            self._bases[stamp.path] = address_of(self._maps[stamp.path])

    def view(self, path: Path, offset: int, num_bytes: int) -> torch.Tensor:
        """`num_bytes` of `path` from `offset`, as a uint8 tensor over the mapping."""
        return torch.frombuffer(self._maps[path], dtype=torch.uint8, count=num_bytes, offset=offset)

    # -- forwards --------------------------------------------------------------

    def enter(self) -> None:
        """Before compute reads a mapping: raise the fault, if any, naming the file; else
        the mappings stay (the leases are kept) until `leave`."""
        if self._fault is not None or not self._active:
            with self._lock:
                if self._fault is None and not self._active and not self._released:
                    self._note(self._problem())  # once per forward, not only by the watcher
                if self._fault is not None:
                    self._release_now()
                    raise DiskReadError(self._fault)
                self._active = True

    def leave(self) -> None:
        """No forward reads the mappings now (a forward ended, or was abandoned)."""
        with self._lock:
            self._active = False
            if self._fault is not None:
                self._release_now()

    def hint(self, extents: Sequence[Extent]) -> None:
        """Bring `extents` into the page cache ahead of use, unless their sampled pages are
        there already (looking at every page costs time). They are read, not only hinted:
        a failing read here is an error at the next `enter`, where a page faulted in by
        compute would be a SIGBUS. The sample is looked at here, in the caller's thread:
        handing every layer's extents to the reading thread cost a warm disk tier a large
        share of its compiled step (a wake-up and the GIL's hand-over per layer, on 2
        cores: docs/benchmarks.md, "2026-11-27 (fifteenth session): the compiled step kept
        on disk, and three of its costs")."""
        missing = tuple(extent for extent in extents if not self._cached(extent))
        if missing and not self._released:
            with contextlib.suppress(RuntimeError):  # closed meanwhile: hints are optional
                self._hints.submit(self._hint, missing)

    def drop(self, extents: Sequence[Extent]) -> None:
        """Take `extents`' pages out of this process (`MADV_DONTNEED`; they stay in the
        page cache), so that they no longer count in its RSS. The mappings are private
        and never written, so nothing is lost: a later read faults the same bytes in
        from the file again (the pages at either end may be a neighbour's: the same)."""
        with self._lock:  # (not while the mappings are being replaced by zero pages)
            if self._released:
                return
            for extent in extents:
                size = self._span(extent)
                if size > 0:
                    start = extent.file_offset // mmap.PAGESIZE * mmap.PAGESIZE
                    end = extent.file_offset + size
                    self._maps[extent.path].madvise(mmap.MADV_DONTNEED, start, end - start)

    def _cached(self, extent: Extent) -> bool:
        """Whether `extent`'s sampled pages are in the page cache (True where it maps
        nothing: there is nothing to read)."""
        size = self._span(extent)
        return size <= 0 or _sampled_pages_cached(
            self._bases[extent.path], extent.file_offset, size
        )

    def _span(self, extent: Extent) -> int:
        """The bytes of `extent` its mapping holds (0: none, or the mappings are gone)."""
        mapped = self._maps.get(extent.path)
        if mapped is None or self._released:
            return 0
        return min(extent.num_bytes, len(mapped) - extent.file_offset)

    def _hint(self, extents: tuple[Extent, ...]) -> None:
        for extent in extents:
            if self._released:
                return
            size = self._span(extent)
            if size > 0:
                try:
                    _populate(self._fds[extent.path], extent.file_offset, size)
                except (OSError, KeyError) as error:
                    reason = getattr(error, "strerror", None) or str(error)
                    with self._lock:
                        self._fault = self._fault or f"reading {extent.path} failed: {reason}"
                    return

    def close(self) -> None:
        """Stop watching, replace the mappings by zero pages and give the leases back
        (tensors over a mapping keep its memory alive; they read zeros from then on)."""
        self._stop.set()
        self._hints.shutdown(wait=True)
        with self._lock:
            self._fault = self._fault or "the offloader was closed"
            self._release_now()

    # -- the watcher -----------------------------------------------------------

    def _look(self) -> bool:
        """One look at the leases and the files; True when the watch is over."""
        with self._lock:  # the files stay open while it looks
            if self._released:
                return True
            problem = self._problem()
        if problem is None:
            return False
        with self._lock:
            self._note(problem)
            if not self._active:
                self._release_now()
        return True

    def _note(self, problem: str | None) -> None:
        """(Under the lock.) Keep the first fault."""
        if problem is not None and self._fault is None:
            self._fault = (
                f"{problem} while the model was running; weights are mapped from it: "
                "reload the model after changing its files"
            )

    def _problem(self) -> str | None:
        for path, stamp in self._stamps.items():
            fd = self._fds[path]
            if fcntl.fcntl(fd, _F_GETLEASE) != fcntl.F_RDLCK:
                return f"{path} is being written or truncated"
            try:
                problem = stamp.differs(os.stat(path))
            except FileNotFoundError:
                problem = "was removed"
            if problem is not None:
                return f"{path} {problem}"
        return None

    def _release_now(self) -> None:
        """(Under the lock.) Zero pages over every mapping, then the leases go."""
        if not self._released:
            self._release()

    def _release(self) -> None:
        self._released = True
        for mapped in self._maps.values():
            _zero_pages(mapped)
        for fd in self._fds.values():
            _give_back(fd, self._pid)
        self._fds.clear()


def _watch(files: weakref.ref[MappedFiles], stop: threading.Event) -> None:
    while not stop.wait(POLL_S):
        watched = files()
        if watched is None or watched._look():
            return
        del watched  # not held between looks


def _drop(
    stop: threading.Event, hints: ThreadPoolExecutor, fds: dict[Path, int], owner: int
) -> None:
    """Files that were never closed and are no longer referenced: the threads end and
    the leases go (the mappings themselves go with the last tensor over them)."""
    stop.set()
    hints.shutdown(wait=False, cancel_futures=True)
    for fd in list(fds.values()):
        _give_back(fd, owner)
    fds.clear()


def _give_back(fd: int, owner: int) -> None:
    """Close a leased file. A lease belongs to the open file, which a forked child
    shares: only the process that took it gives it back (a child that closes its copy
    must not end the parent's lease)."""
    if os.getpid() == owner:
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_UNLCK)
    with contextlib.suppress(OSError):
        os.close(fd)


_POPULATE_CHUNK_BYTES = 4 * 2**20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_MAP_FAILED = ctypes.c_void_p(-1).value


def address_of(mapped: mmap.mmap) -> int:
    return torch.frombuffer(mapped, dtype=torch.uint8, count=1).data_ptr()


def _zero_pages(mapped: mmap.mmap) -> None:
    """Map anonymous zero pages over `mapped`'s range, in place: reads of it never fault
    again, whatever happens to the file. (Its owner still unmaps the range when freed.)"""
    size = -(-len(mapped) // mmap.PAGESIZE) * mmap.PAGESIZE
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10  # 0x10: MAP_FIXED
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    result = _libc.mmap(address_of(mapped), size, prot, flags, -1, 0)
    if result == _MAP_FAILED:
        raise OSError(ctypes.get_errno(), "cannot replace a mapped checkpoint file")


def _populate(fd: int, offset: int, num_bytes: int) -> None:
    """Read a range through the page cache (into a scratch buffer), so its pages are there."""
    scratch = bytearray(min(num_bytes, _POPULATE_CHUNK_BYTES))
    view = memoryview(scratch)
    done = 0
    while done < num_bytes:
        count = os.preadv(fd, [view[: min(len(scratch), num_bytes - done)]], offset + done)
        if count == 0:
            raise OSError(0, f"the file ends at byte {offset + done}, inside a mapped layer")
        done += count


def _sampled_pages_cached(base: int, offset: int, num_bytes: int) -> bool:
    """Whether a few pages of the range (first, middle, last) of the mapping at `base` are
    in the page cache."""
    page = mmap.PAGESIZE
    first, last = offset // page, (offset + num_bytes - 1) // page
    picks = sorted({first, (first + last) // 2, last})[:_SAMPLED_PAGES]
    vec = (ctypes.c_ubyte * 1)()
    for index in picks:
        if _libc.mincore(ctypes.c_void_p(base + index * page), ctypes.c_size_t(page), vec):
            return False
        if not vec[0] & 1:
            return False
    return True


def leases_supported() -> bool:
    return hasattr(fcntl, "F_RDLCK") and os.uname().sysname == "Linux"
