"""Guarded mappings of checkpoint files (disk_io="mmap"): a file changed under them is an
error at the next use, a writer is held while a forward reads them, and a mapping whose
lease is gone is never read again."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import torch

from offload.memory import mapped_files
from offload.memory.disk_layout import Extent
from offload.memory.disk_reader import DiskReadError, FileStamp
from offload.memory.mapped_files import MappedFiles, MappingRefused
from offload.memory.page_cache import cached_bytes, cached_fraction
from offload.offloader.disk_placement import choose_io

SIZE = 3 * 4096 + 100


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * (SIZE // 256) + bytes(SIZE % 256))
    return path


def test_a_view_is_the_files_bytes(data_file):
    mapped = MappedFiles([FileStamp.of(data_file)])
    view = mapped.view(data_file, 4096 + 3, 50)
    assert view.tolist() == list(data_file.read_bytes()[4096 + 3 : 4096 + 53])
    mapped.close()
    assert not view.any()  # closed: zero pages, never the file (which may change now)


def test_a_writer_is_held_while_a_forward_reads_and_the_next_use_fails(data_file):
    mapped = MappedFiles([FileStamp.of(data_file)])
    mapped.enter()  # a forward reads the mapping
    truncating = threading.Thread(target=os.truncate, args=(data_file, 10))
    truncating.start()
    truncating.join(timeout=10 * mapped_files.POLL_S)
    assert truncating.is_alive()  # held by the lease while the forward runs
    assert data_file.stat().st_size == SIZE
    time.sleep(3 * mapped_files.POLL_S)  # the watcher has seen the lease break by now
    with pytest.raises(DiskReadError, match=r"weights\.bin is being written or truncated"):
        mapped.enter()  # the next unit: refused, the mapping goes, the writer goes on
    truncating.join(timeout=10)
    assert not truncating.is_alive() and data_file.stat().st_size == 10
    with pytest.raises(DiskReadError):
        mapped.enter()
    mapped.close()


def test_an_idle_mapping_lets_a_writer_go_at_once(data_file):
    mapped = MappedFiles([FileStamp.of(data_file)])
    view = mapped.view(data_file, 2 * 4096, 4096)
    started = time.perf_counter()
    os.truncate(data_file, 10)
    assert time.perf_counter() - started < 50 * mapped_files.POLL_S
    assert not view.any()  # no SIGBUS past the new end: the pages are zero pages now
    with pytest.raises(DiskReadError, match=r"weights\.bin"):
        mapped.enter()
    mapped.close()


def test_no_lease_no_mapping(data_file):
    writer = os.open(data_file, os.O_WRONLY)  # a file open for writing cannot be leased
    try:
        with pytest.raises(MappingRefused, match=r"cannot hold a read lease on .*weights\.bin"):
            MappedFiles([FileStamp.of(data_file)])
    finally:
        os.close(writer)


def test_a_failing_read_ahead_is_an_error_at_the_next_use(data_file, monkeypatch):
    mapped = MappedFiles([FileStamp.of(data_file)])

    def failing(*args):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(mapped_files, "_sampled_pages_cached", lambda *args: False)
    monkeypatch.setattr(mapped_files.os, "preadv", failing)
    mapped.hint([Extent(data_file, 0, 8192, 0)])
    mapped._hints.submit(lambda: None).result()  # the hint has run
    with pytest.raises(DiskReadError, match=r"reading .*weights\.bin failed: Input/output"):
        mapped.enter()
    mapped.close()


def test_a_hint_hands_only_missing_pages_to_the_reading_thread(data_file, monkeypatch):
    mapped = MappedFiles([FileStamp.of(data_file)])
    handed = []
    monkeypatch.setattr(mapped._hints, "submit", lambda fn, extents: handed.append(extents))
    cached, missing = Extent(data_file, 0, 4096, 0), Extent(data_file, 8192, 4096, 0)
    monkeypatch.setattr(
        mapped_files, "_sampled_pages_cached", lambda base, offset, size: offset == 0
    )
    mapped.hint([cached, missing])
    mapped.hint([cached])  # all there: no hand-over (a wake-up per layer costs a step)
    assert handed == [(missing,)]
    mapped.close()


def test_page_cache_residency_is_measured(data_file):
    fd = os.open(data_file, os.O_RDONLY)
    os.fsync(fd)  # dirty pages cannot be dropped
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    assert cached_bytes(data_file) == 0
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead beyond the page read
    os.pread(fd, 4096, 4096)  # the second page only
    os.close(fd)
    assert cached_bytes(data_file, [(4096, 4096)]) == 4096
    assert cached_fraction([(data_file, 0, 4096), (data_file, 4096, 4096)]) == 0.5


CPU, GPU = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(
    ("requested", "device", "cached", "can_map", "fits", "chosen"),
    [
        ("auto", CPU, 1.0, True, False, "mmap"),
        ("auto", CPU, 0.95, True, False, "mmap"),
        ("auto", CPU, 0.5, True, False, "direct"),  # cold, larger than the cache can hold
        ("auto", CPU, 0.0, True, True, "mmap"),  # cold, but the page cache will hold it
        ("auto", CPU, 1.0, False, True, "page-cache"),  # no leases, or misaligned weights
        ("auto", CPU, 0.5, False, False, "direct"),
        ("auto", GPU, 1.0, True, True, "direct"),  # a GPU reads into pinned staging
        ("page-cache", CPU, 1.0, True, True, "page-cache"),
        ("direct", CPU, 1.0, True, True, "direct"),
        ("mmap", CPU, 0.0, True, False, "mmap"),
    ],
)
def test_the_io_chosen(requested, device, cached, can_map, fits, chosen):
    assert choose_io(requested, device, cached, can_map, fits) == chosen


def test_mapping_needs_the_cpu():
    with pytest.raises(ValueError, match=r"disk_io='mmap' .* needs the CPU as compute device"):
        choose_io("mmap", GPU, 1.0)
