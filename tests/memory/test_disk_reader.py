"""The disk reader: aligned layouts, exact bytes, ordering per buffer, and every fault
as one error naming the file."""

from __future__ import annotations

import errno
import itertools
import os
import re
import threading
import time
from pathlib import Path

import file_faults
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pagecache import cached_bytes

from offload.memory import disk_reader
from offload.memory.disk_layout import (
    ALIGN,
    HOME_ALIGN,
    TensorRange,
    aligned_empty,
    plan_layout,
)
from offload.memory.disk_reader import DiskReader, DiskReadError, FileStamp


def _file(path: Path, num_bytes: int, seed: int = 0) -> bytes:
    data = torch.randint(0, 256, (num_bytes,), generator=torch.Generator().manual_seed(seed))
    raw = bytes(data.to(torch.uint8).numpy())
    path.write_bytes(raw)
    return raw


def _read(reader: DiskReader, ranges: list[TensorRange]) -> list[bytes]:
    layout = plan_layout(ranges)
    buffer = aligned_empty(layout.num_bytes)
    reader.wait(reader.read(buffer, layout.extents, moves=layout.moves))
    raw = bytes(buffer.numpy())
    return [raw[o : o + r.num_bytes] for o, r in zip(layout.tensor_offsets, ranges, strict=True)]


@settings(max_examples=60, deadline=None)
@given(
    pieces=st.lists(
        st.tuples(st.integers(0, 1), st.integers(0, 30000), st.integers(0, 9000)),
        min_size=1,
        max_size=8,
    )
)
def test_layout_reads_aligned_blocks_and_moves_each_range_to_an_aligned_home(pieces):
    """The reads are whole aligned blocks that do not overlap in the buffer; once they
    have landed, the moves (in order, memmove's semantics) leave every range's bytes at
    its home, a multiple of HOME_ALIGN, homes not overlapping (ranges may overlap)."""
    ranges = [TensorRange(Path(f"f{f}"), offset, size) for f, offset, size in pieces]
    layout = plan_layout(ranges)
    ends = []
    for extent in layout.extents:
        assert extent.file_offset % ALIGN == 0 and extent.num_bytes % ALIGN == 0
        assert extent.buffer_offset % ALIGN == 0
        ends.append((extent.buffer_offset, extent.buffer_offset + extent.num_bytes))
    assert all(a[1] <= b[0] for a, b in zip(sorted(ends), sorted(ends)[1:], strict=False))
    read_end = sum(e.num_bytes for e in layout.extents)
    assert read_end <= layout.num_bytes <= read_end + sum(r.num_bytes + HOME_ALIGN for r in ranges)
    files = {f"f{f}": bytes((7 * i + 13 * f) % 251 for i in range(45_000)) for f in (0, 1)}
    buffer = bytearray(layout.num_bytes)
    for extent in layout.extents:
        data = files[str(extent.path)][extent.file_offset : extent.file_offset + extent.num_bytes]
        buffer[extent.buffer_offset : extent.buffer_offset + len(data)] = data
    for move in layout.moves:
        chunk = bytes(buffer[move.source : move.source + move.num_bytes])
        buffer[move.target : move.target + move.num_bytes] = chunk
    homes = sorted(zip(layout.tensor_offsets, ranges, strict=True), key=lambda h: h[0])
    for home, piece in homes:
        assert home % HOME_ALIGN == 0
        want = files[str(piece.path)][piece.offset : piece.offset + piece.num_bytes]
        assert bytes(buffer[home : home + piece.num_bytes]) == want
    spans = [(home, home + piece.num_bytes) for home, piece in homes if piece.num_bytes]
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


@pytest.mark.parametrize("io", ["direct", "page-cache"])
@pytest.mark.parametrize("chunk_bytes", [ALIGN, 3 * ALIGN, 2**20])
def test_reads_give_the_files_bytes(tmp_path, io, chunk_bytes):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    raw_a, raw_b = _file(a, 50_001, seed=1), _file(b, 12_345, seed=2)
    ranges = [
        TensorRange(a, 8, 4000),
        TensorRange(b, 5000, 7345),  # runs to the end of the file
        TensorRange(a, 40_000, 10_001),
        TensorRange(a, 4008, 100),  # in the same run as the first
    ]
    reader = DiskReader(
        [FileStamp.of(a), FileStamp.of(b)], io=io, chunk_bytes=chunk_bytes, num_threads=3
    )
    got = _read(reader, ranges)
    want = [(raw_a if r.path == a else raw_b)[r.offset : r.offset + r.num_bytes] for r in ranges]
    assert got == want
    assert reader.stats.bytes_read > 0 and reader.stats.num_reads >= 3
    reader.close()


@pytest.mark.parametrize(
    ("layer_blocks", "least_blocks", "threads", "requests"),
    [(64, 1, 2, [32, 32]), (64, 1, 3, [22, 22, 20]), (64, 48, 2, [48, 16]), (8, 16, 2, [8])],
)
def test_a_layers_read_is_one_request_per_thread(
    tmp_path, layer_blocks, least_blocks, threads, requests
):
    """Fewer, larger requests: each wakes its I/O thread, which a CPU computing beside
    the reads runs late (docs/design.md); each at least `chunk_bytes`, in whole blocks."""
    path = tmp_path / "layer.bin"
    raw = _file(path, layer_blocks * ALIGN)
    reader = DiskReader([FileStamp.of(path)], num_threads=threads, chunk_bytes=least_blocks * ALIGN)
    pread, sizes = reader._pread, []
    reader._pread = lambda path, offset, target: (
        sizes.append(target.numel()) or pread(path, offset, target)
    )
    assert _read(reader, [TensorRange(path, 0, layer_blocks * ALIGN)]) == [raw]
    assert sorted(sizes, reverse=True) == [ALIGN * n for n in requests]
    reader.close()


def test_a_read_into_a_buffer_lands_after_the_read_before_it(tmp_path):
    """Two reads into one buffer: the second must win even when the first is slow (a
    read abandoned by a Ctrl-C may still be running when the slot is loaded again)."""
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    _file(a, ALIGN, seed=3)
    raw_b = _file(b, ALIGN, seed=4)
    reader = DiskReader([FileStamp.of(a), FileStamp.of(b)], num_threads=2)
    buffer = aligned_empty(ALIGN)
    first = reader.read(buffer, plan_layout([TensorRange(a, 0, ALIGN)]).extents, after=_sleep)
    second = reader.read(buffer, plan_layout([TensorRange(b, 0, ALIGN)]).extents)
    reader.wait(second)
    reader.wait(first)
    assert bytes(buffer.numpy()) == raw_b
    reader.close()


def _sleep() -> None:
    time.sleep(0.2)


def _fault_cases():
    def truncate(path):
        os.truncate(path, 5000)

    return {
        **file_faults.COMMON,
        "truncated": truncate,
    }


@pytest.mark.parametrize("fault", sorted(_fault_cases()))
def test_a_file_changed_after_loading_is_one_error_naming_it(tmp_path, fault):
    path = tmp_path / "model.safetensors"
    _file(path, 20_000)
    reader = DiskReader([FileStamp.of(path)])
    assert _read(reader, [TensorRange(path, 0, 10_000)])  # fine before the change
    _fault_cases()[fault](path)
    with pytest.raises(DiskReadError, match=re.escape(str(path))):
        _read(reader, [TensorRange(path, 0, 10_000)])
    with pytest.raises(DiskReadError, match=re.escape(str(path))):  # and every read after it
        reader.read(aligned_empty(ALIGN), [])
    _assert_threads_end(reader)


def test_a_missing_file_at_load_time_names_it(tmp_path):
    with pytest.raises(DiskReadError, match=r"nothing\.safetensors"):
        FileStamp.of(tmp_path / "nothing.safetensors")


def test_an_io_error_is_one_error_naming_the_file_and_the_threads_end(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    _file(path, 20_000)
    reader = DiskReader([FileStamp.of(path)], num_threads=2)

    def failing(*args):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(disk_reader.os, "preadv", failing)
    with pytest.raises(DiskReadError, match=rf"reading {path} failed: Input/output error"):
        _read(reader, [TensorRange(path, 0, 20_000)])
    _assert_threads_end(reader)


def test_a_read_that_fails_while_its_chunks_are_still_queued_is_the_same_error(
    tmp_path, monkeypatch
):
    """The first chunk's error ends the threads while `read` still queues the others:
    that is the same one-line error, never the executor's "cannot schedule new futures"."""
    path = tmp_path / "model.safetensors"
    _file(path, 2**20)
    monkeypatch.setattr(disk_reader.os, "preadv", _eio)
    for _ in range(20):
        reader = DiskReader([FileStamp.of(path)], num_threads=2, chunk_bytes=4096)
        with pytest.raises(DiskReadError, match="Input/output error"):
            _read(reader, [TensorRange(path, 0, 2**20)])
        reader.close()


def _eio(*args):
    raise OSError(errno.EIO, os.strerror(errno.EIO))


def _assert_threads_end(reader: DiskReader) -> None:
    threads = list(reader._pool._threads)
    assert threads
    for thread in threads:
        thread.join(timeout=5)
    assert not any(t.is_alive() for t in threads)


def test_direct_reads_leave_the_page_cache_alone(tmp_path):
    """O_DIRECT (or a dropped range) reads do not add the file to the page cache."""
    path = tmp_path / "big.bin"
    _file(path, 8 * 2**20)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    before = cached_bytes(path)
    reader = DiskReader([FileStamp.of(path)], io="direct")
    _read(reader, [TensorRange(path, 0, 8 * 2**20)])
    reader.close()
    assert cached_bytes(path) <= before + 2**20


def test_a_fault_with_reads_still_queued_raises_instead_of_hanging(tmp_path, monkeypatch):
    """The first fault cancels the reads still queued; waiting for them must end (a
    cancelled future never counts as done for `concurrent.futures.wait`)."""
    path = tmp_path / "model.safetensors"
    _file(path, 64 * ALIGN)
    reader = DiskReader([FileStamp.of(path)], num_threads=1, chunk_bytes=ALIGN)

    def failing(*args):
        time.sleep(0.01)  # the other chunks are queued by now
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(disk_reader.os, "preadv", failing)
    # (two runs apart: two requests on the one thread, whatever a request's size)
    layout = plan_layout(
        [TensorRange(path, 0, 8 * ALIGN), TensorRange(path, 32 * ALIGN, 8 * ALIGN)]
    )
    ticket = reader.read(aligned_empty(layout.num_bytes), layout.extents)
    outcome = []

    def wait():
        try:
            reader.wait(ticket)
        except DiskReadError as error:
            outcome.append(error)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(timeout=10)
    assert not waiter.is_alive() and outcome
    assert any(f.cancelled() for f in ticket.futures)  # the case this test is about


def _huge_page_kib(buffer) -> int:
    """AnonHugePages of the mapping that holds `buffer`'s first byte (/proc/self/smaps)."""
    address, inside, found = buffer.data_ptr(), False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            found = int(line.split()[1])
    return found


def test_a_large_read_buffer_starts_on_a_huge_page_and_gets_huge_pages():
    from offload.memory.disk_layout import HUGE_PAGE

    small = aligned_empty(HUGE_PAGE - ALIGN)
    assert small.data_ptr() % ALIGN == 0 and small.numel() == HUGE_PAGE - ALIGN
    buffer = aligned_empty(3 * HUGE_PAGE)
    assert buffer.data_ptr() % HUGE_PAGE == 0 and buffer.numel() == 3 * HUGE_PAGE
    buffer.fill_(1)  # the first touch: the kernel picks the pages now
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not setting.exists() or "[never]" in setting.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    # O_DIRECT reads into 4 KiB pages ran at half the rate (docs/benchmarks.md).
    assert _huge_page_kib(buffer) >= 2 * HUGE_PAGE // 1024
