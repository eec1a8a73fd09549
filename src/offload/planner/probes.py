"""The machine's rates, measured for the planner: host -> device copies (a memory copy on
a CPU), kernels reading host memory in place (GPU), and the disk's sequential read with
`O_DIRECT` through the disk tier's own reader. Each is a median of a few repeats."""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from offload.memory.disk_layout import ALIGN, Extent, aligned_empty
from offload.memory.disk_reader import DiskReader, FileStamp
from offload.memory.host import device_view

_READ_BYTES = 64 * 2**20  # one read of the disk probe; two are in flight


class Clock:
    """Times a callable on `device`: CUDA events on a GPU (no host round trip inside the
    timed span), the wall clock on a CPU."""

    def __init__(self, device: torch.device):
        self.device = device

    def seconds(self, fn: Callable[[], object], warmup: int, repeats: int) -> float:
        """The median of `repeats` timed calls of `fn`, after `warmup` untimed ones."""
        for _ in range(warmup):
            fn()
        return statistics.median(self.once(fn) for _ in range(repeats))

    def once(self, fn: Callable[[], object]) -> float:
        if self.device.type != "cuda":
            started = time.perf_counter()
            fn()
            return time.perf_counter() - started
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        fn()
        end.record()
        end.synchronize()  # the span is over only when the device has run it
        return start.elapsed_time(end) / 1e3


def link_gb_per_s(device: torch.device, num_bytes: int, warmup: int, repeats: int) -> float:
    """Host -> `device` copies from pinned memory, GB/s; on a CPU, a memory copy of
    `num_bytes` (each byte counted once)."""
    pinned = device.type == "cuda"
    source = torch.ones(num_bytes, dtype=torch.uint8, pin_memory=pinned)
    target = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    seconds = Clock(device).seconds(
        lambda: target.copy_(source, non_blocking=pinned), warmup, repeats
    )
    return num_bytes / seconds / 1e9


def uva_gb_per_s(device: torch.device, num_bytes: int, warmup: int, repeats: int) -> float:
    """A kernel reading pinned host memory in place through a zero-copy view (GPU), GB/s;
    0 where there is no such view (a CPU reads host memory as its own)."""
    if device.type != "cuda":
        return 0.0
    host = torch.ones(num_bytes // 4, dtype=torch.float32, pin_memory=True)
    try:
        view = device_view(host, device)
    except RuntimeError:  # no zero-copy views here: UVA reads are not an option
        return 0.0
    target = torch.empty_like(view, device=device)
    seconds = Clock(device).seconds(lambda: torch.neg(view, out=target), warmup, repeats)
    return host.numel() * 4 / seconds / 1e9


def disk_gb_per_s(files: list[Path], max_bytes: int, threads: int) -> float:
    """Sequential reads of `files` in order (up to `max_bytes`), around the page cache, by
    the disk tier's reader on `threads` I/O threads, two reads in flight; GB/s."""
    for path in files:  # pages cached already would be read from memory, not the disk
        _drop_cached(path)
    reader = DiskReader([FileStamp.of(p) for p in files], num_threads=threads, io="direct")
    buffers = [aligned_empty(_READ_BYTES) for _ in range(2)]
    tickets = []  # the reads in flight, oldest first; read k lands in buffers[k % 2]
    num_bytes, started = 0, time.perf_counter()
    try:
        for k, (path, offset, length) in enumerate(_pieces(files, max_bytes)):
            if len(tickets) == len(buffers):  # its buffer is free once read k - 2 landed
                reader.wait(tickets.pop(0), count_stall=False)
            extent = Extent(path, offset, -(-length // ALIGN) * ALIGN, 0)
            tickets.append(reader.read(buffers[k % 2], [extent]))
            num_bytes += length
        for ticket in tickets:
            reader.wait(ticket, count_stall=False)
    finally:
        reader.close()
    return num_bytes / (time.perf_counter() - started) / 1e9


def _pieces(files: list[Path], max_bytes: int):
    """(file, offset, length) of each read, in order, until `max_bytes` are covered."""
    remaining = max_bytes
    for path in files:
        size = path.stat().st_size
        for offset in range(0, size, _READ_BYTES):
            if remaining <= 0:
                return
            length = min(_READ_BYTES, size - offset)
            yield path, offset, length
            remaining -= length


def _drop_cached(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def probe_file(folder: Path, num_bytes: int):
    """A file of `num_bytes` written in `folder` (on the disk checkpoints are read from
    when there is no checkpoint to read), its pages on disk; removed afterwards."""
    folder.mkdir(parents=True, exist_ok=True)
    descriptor, name = tempfile.mkstemp(prefix=".disk-probe-", dir=folder)
    path = Path(name)
    try:
        block = torch.arange(_READ_BYTES, dtype=torch.int32).to(torch.uint8).numpy().tobytes()
        with os.fdopen(descriptor, "wb") as file:
            for offset in range(0, num_bytes, len(block)):
                file.write(block[: num_bytes - offset])
            file.flush()
            os.fsync(file.fileno())  # written pages are on disk, so the read comes from it
        yield path
    finally:
        path.unlink(missing_ok=True)
