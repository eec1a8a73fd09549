import ctypes
import gc
import os
import sys
import time
import weakref

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from offload.memory import host
from offload.memory.host import (
    ALIGN_BYTES,
    HostSlab,
    TensorSpec,
    pack_offsets,
    trim_freed_memory,
    zero_copy_available,
)


@given(st.lists(st.integers(0, 10_000), max_size=20), st.sampled_from([1, 16, 256, 4096]))
def test_pack_offsets_are_aligned_disjoint_and_tight(sizes, align):
    offsets, total = pack_offsets(sizes, align)
    assert all(offset % align == 0 for offset in offsets)
    ends = [o + s for o, s in zip(offsets, sizes, strict=True)]
    for i in range(1, len(sizes)):
        assert ends[i - 1] <= offsets[i] < ends[i - 1] + align  # no overlap, minimal gap
    assert total == (ends[-1] if sizes else 0)
    assert total <= sum(sizes) + len(sizes) * (align - 1)


def test_slab_views_hold_tensors_of_each_dtype():
    specs = [
        TensorSpec((3, 5), torch.float32),
        TensorSpec((7,), torch.bfloat16),
        TensorSpec((2, 2), torch.int8),
        TensorSpec((0,), torch.float16),
    ]
    slab = HostSlab(specs)
    assert slab.payload_bytes == 60 + 14 + 4
    assert slab.num_bytes <= slab.payload_bytes + len(specs) * ALIGN_BYTES
    for view, spec in zip(slab.views, specs, strict=True):
        assert view.shape == spec.shape and view.dtype == spec.dtype and view.device.type == "cpu"
        assert view.data_ptr() % ALIGN_BYTES == 0 or view.numel() == 0
    sources = [
        torch.randn(3, 5),
        torch.randn(7).bfloat16(),
        torch.tensor([[1, -2], [3, 4]], dtype=torch.int8),
    ]
    for view, source in zip(slab.views, sources, strict=False):
        view.copy_(source)
    for view, source in zip(slab.views, sources, strict=False):
        assert torch.equal(view, source)
    assert not slab.is_pinned


def test_slab_memory_lives_as_long_as_a_view():
    slab = HostSlab([TensorSpec((1024,), torch.float32)])
    block = weakref.ref(slab._block)
    view = slab.views[0]
    view.fill_(3.0)
    del slab
    gc.collect()
    assert block() is not None and torch.all(view == 3.0)
    del view
    gc.collect()
    assert block() is None


def test_pinning_is_only_for_cuda(monkeypatch):
    assert not host.should_pin_memory(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert host.should_pin_memory(torch.device("cuda"))
    assert not host.should_pin_memory(torch.device("cuda"), disabled=True)
    monkeypatch.setenv("VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY", "1")
    assert not host.should_pin_memory(torch.device("cuda"))


@pytest.mark.parametrize(
    ("device", "pinned", "disabled", "env", "expected"),
    [
        ("cpu", False, False, None, True),
        ("cpu", False, True, None, False),
        ("cpu", False, False, "1", False),
        ("cuda", True, False, None, True),
        ("cuda", False, False, None, False),  # views need registered memory
        ("cuda", True, False, "true", False),
        ("cuda", True, False, "0", True),
        ("mps", True, False, None, False),
    ],
)
def test_zero_copy_available(monkeypatch, device, pinned, disabled, env, expected):
    if env is not None:
        monkeypatch.setenv("VLLM_WEIGHT_OFFLOADING_DISABLE_UVA", env)
    assert zero_copy_available(torch.device(device), pinned, disabled) is expected


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_trim_hands_freed_heap_pages_back():
    """Freed blocks pinned in the heap by small live ones stay in RSS until trimmed (what
    a dropped model's tensors do); `trim_freed_memory` returns them."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = []
    for _ in range(2048):  # 128 MiB in 64 KiB blocks (under malloc's mmap threshold)
        block = libc.malloc(64 * 1024)
        ctypes.memset(block, 1, 64 * 1024)
        blocks.append(block)
    for block in blocks[::2]:  # the live ones between keep the freed ones from merging
        libc.free(block)
    before = _rss_bytes()
    assert trim_freed_memory()
    after = _rss_bytes()
    for block in blocks[1::2]:
        libc.free(block)
    assert before - after > 32 * 2**20, (before / 2**20, after / 2**20)


def test_an_llm_closed_or_made_trims_the_heap(monkeypatch, tmp_path):
    import zoo

    from offload.llm import llm as llm_module

    calls = []
    monkeypatch.setattr(llm_module, "trim_freed_memory", lambda: calls.append(1))
    llm = llm_module.LLM(zoo.save_attentive_llm(tmp_path))
    assert len(calls) == 1  # made: what models dropped before it left
    llm.close()
    assert len(calls) == 2


def test_an_llm_dropped_without_close_trims_the_heap_at_the_next_collection(monkeypatch, tmp_path):
    """Its finalizer runs before its tensors are freed: the trim waits for the end of the
    collection that frees them (without it, a loop of made-and-dropped models kept 100+
    MiB of freed tensors in RSS: docs/benchmarks.md)."""
    import gc

    import zoo

    from offload.llm import llm as llm_module
    from offload.memory import host

    calls = []
    monkeypatch.setattr(host, "trim_freed_memory", lambda: calls.append(1))
    gc.collect()  # what earlier tests dropped
    calls.clear()
    llm = llm_module.LLM(zoo.save_attentive_llm(tmp_path))
    gc.collect()
    assert calls == []  # alive: nothing to trim
    del llm
    gc.collect()
    assert len(calls) == 1
    gc.collect()  # once per dropped model, not at every collection
    assert len(calls) == 1


@pytest.mark.usefixtures("ctrl_c_raises")
def test_a_ctrl_c_during_the_trim_at_a_collection_still_stops_the_program(monkeypatch):
    """CPython only prints a KeyboardInterrupt that leaves a gc callback ("Exception
    ignored"): the trim's callback sends it again, and the code that collected gets it."""
    from offload.memory import host

    dropped = []  # (instead of tests/interrupts.py's hook, which would raise it again)
    monkeypatch.setattr(sys, "unraisablehook", dropped.append)

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(host, "trim_freed_memory", interrupted)
    host.trim_after_collection()
    with pytest.raises(KeyboardInterrupt):
        gc.collect()
        for _ in range(500):  # (it comes within milliseconds, from a helper thread)
            time.sleep(0.01)
    assert dropped == []


def test_give_back_zeroes_a_tensor_and_leaves_the_bytes_beside_it():
    """The rows' KV cache on a CPU (`RowCache.release`): a tensor's whole pages go back to
    the OS and read as zeros; the bytes it shares a page with at either end are written as
    zeros; nothing outside it changes."""
    from offload.memory.host import give_back

    buffer = torch.full((5 * 2**20,), 7, dtype=torch.uint8)
    end = 1000 + 4 * 2**20 + 124  # (starts and ends inside a page)
    give_back(buffer[1000:end].view(torch.float32))
    assert not buffer[1000:end].any()
    assert (buffer[:1000] == 7).all() and (buffer[end:] == 7).all()
    buffer[1000:1010] = 3  # (a given-back page takes writes again)
    assert buffer[990:1010].tolist() == [7] * 10 + [3] * 10
