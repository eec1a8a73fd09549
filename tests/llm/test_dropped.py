"""An `LLM` dropped without `close()` gives back what it held: files, mappings, read
leases and threads, in every disk mode (a server makes and drops many)."""

import gc
import os
import threading

import pytest
import zoo

from offload import SamplingParams
from offload.llm.llm import LLM

LOOPS = 5  # flat from the second on (20 by hand: the same figures)


def _held(path):
    """Open files, threads, mappings of the checkpoint's files, and leases now."""
    with open("/proc/self/maps") as mapped:
        maps = sum(1 for line in mapped if str(path) in line)
    pid = str(os.getpid())
    with open("/proc/locks") as locks:
        leases = sum(1 for line in locks if "LEASE" in line and pid in line.split())
    return len(os.listdir("/proc/self/fd")), threading.active_count(), maps, leases


@pytest.mark.parametrize("io", ["direct", "page-cache", "mmap"])
def test_an_llm_dropped_without_close_leaves_nothing_behind(tmp_path, io):
    path = zoo.save_tiny_llm(tmp_path, num_layers=4)
    seen = []
    for _ in range(LOOPS):
        llm = LLM(path, cpu_memory_gb=0, disk_io=io)
        llm.generate(["t3 t4"], SamplingParams(max_tokens=2), use_tqdm=False)
        assert llm.offloader.stats().disk.io == io  # the disk tier streamed
        del llm
        gc.collect()
        seen.append(_held(path))
    after_two = seen[1]  # (the first loops start what stays: torch's own threads)
    for files, threads, maps, leases in seen[1:]:
        assert files <= after_two[0] and threads <= after_two[1], seen
        assert maps == 0 and leases == 0, seen
