"""The disk's rates, read the way the disk tier reads (its own `DiskReader`, with
`O_DIRECT`, around the page cache; alone or beside compute, a checkpoint's layers in the
order they run), and reads from the page cache. Every O_DIRECT read of the package goes
through `memory.disk_reader`."""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from pathlib import Path

import torch

from offload.memory.disk_layout import ALIGN, Extent, TensorRange, aligned_empty, plan_layout
from offload.memory.disk_reader import CHUNK_BYTES, DiskReader, FileStamp
from offload.memory.page_cache import cached_bytes, drop_cached, read_cached
from offload.memory.placement import DiskIO
from offload.memory.safetensors import checkpoint_tensors
from offload.sizes import MIB

_READ_BYTES = 64 * MIB  # one read of the disk probe; two are in flight


def disk_gb_per_s(
    files: list[Path],
    max_bytes: int,
    threads: int,
    *,
    computing: bool = False,
    reads: list[tuple[Extent, ...]] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    max_read_bytes: int | None = None,
) -> float:
    """Reads around the page cache by the disk tier's reader on `threads` I/O threads (each
    read split into a request per thread, at least `chunk_bytes`), two in flight, up to
    `max_bytes`: `reads` in their order (each one layer's extents, see `layer_reads`, cut
    into reads of `max_read_bytes` at most where given: the probe's buffers stay within a
    memory budget), else `files` sequentially; GB/s. With `computing`, matrix products run
    on the compute threads meanwhile, as a layer's compute does beside the tier's reads (on
    a CPU they take the cores the reads need)."""
    if reads:
        reads = _capped(reads, max_bytes)
        reads = reads if max_read_bytes is None else _split(reads, max_read_bytes)
    else:
        reads = list(_pieces(files, max_bytes, min(_READ_BYTES, max_read_bytes or _READ_BYTES)))
    touched = sorted({extent.path for extents in reads for extent in extents})
    drop_cached(touched)  # pages cached already would be read from memory, not the disk
    reader = DiskReader(
        [FileStamp.of(p) for p in touched],
        num_threads=threads,
        io=DiskIO.DIRECT,
        chunk_bytes=chunk_bytes,
    )
    with _computing() if computing else contextlib.nullcontext():
        started = time.perf_counter()
        num_bytes = _read_all(reader, reads)
        seconds = time.perf_counter() - started
    return num_bytes / seconds / 1e9


def layer_reads(path: Path, stack_name: str) -> list[tuple[Extent, ...]]:
    """The reads the disk tier makes for each layer of the stack `stack_name` (its tensors
    named `<stack_name>.<index>.`) of the checkpoint in `path`, in execution order: a
    checkpoint's tensors are stored in name order (layer 10 before layer 2), so the
    layers' order on disk is not the order they are read in. Empty where no tensor has
    such a name."""
    prefix = f"{stack_name}."
    layers: dict[int, list[TensorRange]] = {}
    for name, stored in checkpoint_tensors(path).items():
        index = name.removeprefix(prefix).partition(".")[0]
        if name.startswith(prefix) and index.isdigit():
            piece = TensorRange(stored.path, stored.offset, stored.num_bytes, stored.dtype)
            layers.setdefault(int(index), []).append(piece)
    return [plan_layout(layers[index]).extents for index in sorted(layers)]


def _capped(reads: list[tuple[Extent, ...]], max_bytes: int) -> list[tuple[Extent, ...]]:
    """The first of `reads` that add up to `max_bytes` (one at least)."""
    kept, total = [], 0
    for extents in reads:
        if kept and total >= max_bytes:
            break
        kept.append(extents)
        total += sum(extent.num_bytes for extent in extents)
    return kept


def _split(reads: list[tuple[Extent, ...]], max_read_bytes: int) -> list[tuple[Extent, ...]]:
    """`reads` in the same order, each cut into reads of at most `max_read_bytes` (whole
    `ALIGN` blocks; an extent longer than that is cut too)."""
    limit = max(ALIGN, max_read_bytes // ALIGN * ALIGN)
    pieces = [
        Extent(e.path, e.file_offset + start, min(limit, e.num_bytes - start), 0)
        for extents in reads
        for e in extents
        for start in range(0, e.num_bytes, limit)
    ]
    split, current, size = [], [], 0
    for piece in pieces:
        if current and size + piece.num_bytes > limit:
            split.append(tuple(current))
            current, size = [], 0
        current.append(piece)
        size += piece.num_bytes
    return [*split, tuple(current)] if current else split


def _pieces(files: list[Path], max_bytes: int, read_bytes: int = _READ_BYTES):
    """One extent of `read_bytes` at a time covering `files` in order, until `max_bytes`
    are covered."""
    read_bytes = max(ALIGN, read_bytes // ALIGN * ALIGN)
    remaining = max_bytes
    for path in files:
        size = path.stat().st_size
        for offset in range(0, size, read_bytes):
            if remaining <= 0:
                return
            length = min(read_bytes, size - offset)
            yield (Extent(path, offset, -(-length // ALIGN) * ALIGN, 0),)
            remaining -= length


def _read_all(reader: DiskReader, reads: list[tuple[Extent, ...]]) -> int:
    """Each read's extents into a buffer of its own, two reads in flight; the bytes read
    (the reader closed)."""
    largest = max(sum(extent.num_bytes for extent in extents) for extents in reads)
    buffers = [aligned_empty(largest) for _ in range(2)]
    tickets = []  # the reads in flight, oldest first; read k lands in buffers[k % 2]
    num_bytes = 0
    try:
        for k, extents in enumerate(reads):
            if len(tickets) == len(buffers):  # its buffer is free once read k - 2 landed
                reader.wait(tickets.pop(0), count_stall=False)
            placed, offset = [], 0
            for extent in extents:  # one after another in the buffer
                placed.append(Extent(extent.path, extent.file_offset, extent.num_bytes, offset))
                offset += extent.num_bytes
            tickets.append(reader.read(buffers[k % 2], placed))
            num_bytes += offset
        for ticket in tickets:
            reader.wait(ticket, count_stall=False)
    finally:
        reader.close()
    return num_bytes


@contextlib.contextmanager
def _computing():
    """Matrix products on this process's compute threads (from a thread of their own)
    until the block ends."""
    done = threading.Event()

    def work() -> None:
        left = torch.ones(64, 2048)  # [tokens, hidden]: a decode step's shapes
        right = torch.ones(2048, 2048)
        with torch.inference_mode():
            while not done.is_set():
                torch.mm(left, right)

    worker = threading.Thread(target=work, name="offload-probe-compute", daemon=True)
    worker.start()
    try:
        yield
    finally:
        done.set()
        worker.join()


@contextlib.contextmanager
def kept_warm(files: list[Path]):
    """Files whose every page is in the page cache now, and are not when the block ends
    (O_DIRECT probes drop them), are read back into it: a warm checkpoint stays warm."""
    warm = [path for path in files if cached_bytes(path) >= path.stat().st_size]
    try:
        yield
    finally:
        read_cached(p for p in warm if cached_bytes(p) < p.stat().st_size)


@contextlib.contextmanager
def probe_file(folder: Path, num_bytes: int):
    """A file of `num_bytes` written in `folder` (on the disk checkpoints are read from
    when there is no checkpoint to read), its pages on disk; removed afterwards."""
    folder.mkdir(parents=True, exist_ok=True)
    descriptor, name = tempfile.mkstemp(prefix=".disk-probe-", dir=folder)
    path = Path(name)
    try:
        block = bytes(range(256)) * (MIB // 256)  # (a MiB: written without a large buffer)
        with os.fdopen(descriptor, "wb") as file:
            for offset in range(0, num_bytes, len(block)):
                file.write(block[: num_bytes - offset])
            file.flush()
            os.fsync(file.fileno())  # written pages are on disk, so the read comes from it
        yield path
    finally:
        path.unlink(missing_ok=True)


def cached_read_gb_per_s(paths: list[Path], chunk_bytes: int = 16 * 2**20) -> float:
    """Read bandwidth from the page cache: the files read once to fill it, then read again
    in order, in chunks into one buffer on one thread. GB/s (1e9 bytes)."""
    read_cached(paths)
    buffer = bytearray(chunk_bytes)
    num_bytes = 0
    started = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as file:
            while read := file.readinto(buffer):
                num_bytes += read
    return num_bytes / (time.perf_counter() - started) / 1e9


def cached_file_bytes(paths: list[Path]) -> int:
    """Bytes of the files that are in the page cache now (`mincore` over a mapping)."""
    return sum(cached_bytes(path) for path in paths)


def first_files(files: list[Path], max_bytes: int) -> list[Path]:
    """The first of `files` whose sizes add up to `max_bytes` (at least one file)."""
    chosen, total = [], 0
    for path in files:
        if chosen and total >= max_bytes:
            break
        chosen.append(path)
        total += path.stat().st_size
    return chosen
