"""An `LLM` dropped without `close()` gives back what it held: files, mappings, read
leases and threads, in every disk mode (a server makes and drops many)."""

import contextlib
import gc
import os
import threading

import pytest
import zoo

from offload import SamplingParams
from offload.llm.llm import LLM

LOOPS = 3  # each one checked; flat from the second on (20 by hand: the same figures)


def _held(path, before=frozenset()):
    """Open files of the checkpoint, offload's threads, mappings of the checkpoint and
    this process's leases, now (only what a model holds: other tests' threads, those
    alive `before` the models were made, and torch's own pools do not count)."""
    folder = str(path)
    ours = [t for t in threading.enumerate() if t.name.startswith("offload-") and t not in before]
    for thread in ours:  # told to end (not waited for, as a finalizer must not block)
        thread.join(timeout=5)
    threads = sum(thread.is_alive() for thread in ours)
    gc.collect()  # (what a thread still held when the loop collected is garbage now)
    files = 0  # counted once the threads are gone: a read in flight holds its reader
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            files += os.readlink(f"/proc/self/fd/{fd}").startswith(folder)
    with open("/proc/self/maps") as mapped:
        maps = sum(1 for line in mapped if folder in line)
    pid = str(os.getpid())
    with open("/proc/locks") as locks:
        leases = sum(1 for line in locks if "LEASE" in line and pid in line.split())
    return files, threads, maps, leases


@pytest.mark.parametrize("io", ["direct", "page-cache", "mmap"])
def test_an_llm_dropped_without_close_leaves_nothing_behind(tmp_path, io):
    path = zoo.save_tiny_llm(tmp_path, num_layers=4)
    if io == "mmap":
        zoo.realign(path)  # (a mapping needs aligned weights)
    seen = []
    # (a module fixture of another test on this worker may hold a model while this runs)
    before = frozenset(threading.enumerate())
    for _ in range(LOOPS):
        llm = LLM(path, cpu_memory_gb=0, disk_io=io)
        llm.generate(["t3 t4"], SamplingParams(max_tokens=2), use_tqdm=False)
        assert llm.offloader.stats().disk.io == io  # the disk tier streamed
        del llm
        gc.collect()
        seen.append(_held(path, before))
    assert all(held == (0, 0, 0, 0) for held in seen), seen
