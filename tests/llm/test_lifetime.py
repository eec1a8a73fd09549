"""An LLM nobody references, or one closed, leaves no thread and no offloader behind; one
serving when the program ends is closed then."""

import atexit
import gc
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest
import torch
import zoo

import offload
from offload import ConfigError, SamplingParams
from offload.llm.llm import LLM
from offload.offloader.base import NoopOffloader

FLAGS = {"offload_group_size": 1, "offload_prefetch_step": 2, "kv_offload": True}
GREEDY = SamplingParams(temperature=0, max_tokens=3)


def _copy_threads(besides=()):
    """Copy threads alive now, other than those in `besides` (other tests' objects)."""
    return [
        t for t in threading.enumerate() if t.name.startswith("offload-copy") and t not in besides
    ]


def _no_copy_threads_within(seconds, besides):
    deadline = time.monotonic() + seconds
    while _copy_threads(besides) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not _copy_threads(besides)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return zoo.save_tiny_llm(tmp_path_factory.mktemp("tiny"), num_layers=6)


@pytest.fixture(autouse=True)
def copy_threads(monkeypatch):
    """A free core, so the CPU copies run on copy threads, whose lifetime is tested here
    (with every core computing, they run on the compute thread: no thread at all)."""
    from offload.memory import copy_engine

    monkeypatch.setattr(copy_engine, "available_cores", lambda: torch.get_num_threads() + 1)


def test_an_unreferenced_llm_frees_its_offloader_and_threads(path):
    gc.collect()
    before = set(_copy_threads())
    llm = LLM(path, **FLAGS)
    llm.generate(["t5 t6"], GREEDY, use_tqdm=False)
    assert _copy_threads(before) and offload.get_offloader() is llm.offloader
    offloader, model = weakref.ref(llm.offloader), weakref.ref(llm.model)
    del llm
    gc.collect()
    assert offloader() is None and model() is None, "something still holds the model"
    assert isinstance(offload.get_offloader(), NoopOffloader)
    assert _no_copy_threads_within(5, before)


def test_close_ends_the_threads_at_once_and_later_calls_are_clear_errors(path):
    before = set(_copy_threads())
    with LLM(path, **FLAGS) as llm:
        first = llm.generate(["t5 t6"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        offloader = weakref.ref(llm.offloader)
    assert not _copy_threads(before)  # joined by close(), not later by the collector
    with pytest.raises(ConfigError, match="closed"):
        llm.generate(["t5 t6"], GREEDY, use_tqdm=False)
    llm.close()  # twice is fine
    gc.collect()
    assert offloader() is None
    again = LLM(path, **FLAGS).generate(["t5 t6"], GREEDY, use_tqdm=False)
    assert again[0].outputs[0].token_ids == first


def test_two_llms_with_different_configs_in_one_process_stay_independent(path):
    prefetched = LLM(path, **FLAGS)
    uva = LLM(path, cpu_offload_gb=0.001, kv_offload=True)
    resident = LLM(path)
    expected = resident.generate(["t9 t4 t7"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for _ in range(2):
        for llm in (prefetched, uva):
            out = llm.generate(["t9 t4 t7"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            assert out == expected
    assert prefetched.transfer_stats().weight_copied_bytes > 0


# Exits while its engine thread is busy in a forward, the serving never closed.
_NEVER_CLOSED = textwrap.dedent("""
    import sys, threading
    from offload import SamplingParams
    from offload.llm.llm import LLM

    llm = LLM(sys.argv[1])
    serving = llm.serving()
    ids = llm.get_tokenizer()("t3 t4").input_ids
    busy = threading.Event()
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    for _ in range(8):
        serving.submit(None, ids, params, lambda output: busy.set())
    assert busy.wait(120)
    print("exiting")
""")


def test_a_serving_never_closed_is_closed_at_exit_without_an_abort(path):
    # Without the engine's exit hook, CPython ended its daemon thread inside torch's C++:
    # "terminate called without an active exception" and SIGABRT (status 134).
    done = subprocess.run(
        [sys.executable, "-c", _NEVER_CLOSED, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "terminate called" not in done.stderr
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "exiting\n"


def test_closing_the_serving_takes_its_exit_hook_back(path, monkeypatch):
    hooks = []  # (atexit._ncallbacks() counts a hook taken back, on 3.11: not used)
    monkeypatch.setattr(atexit, "register", hooks.append)
    monkeypatch.setattr(atexit, "unregister", hooks.remove)
    llm = LLM(path)
    llm.serving()
    assert len(hooks) == 1
    llm.close()
    assert hooks == []
