"""The compiled CPU step made in the background (engine/step_jobs.py): no decode step waits
for a compile or a load; steps run eagerly until it is ready, compiled after; a compile
that finishes after its LLM closed keeps nothing."""

import importlib
import subprocess
import sys
import threading

import pytest
from torch._dynamo.utils import counters

from offload import SamplingParams
from offload.engine import compiled_step, cpu_linear, cpu_step, step_cache
from offload.engine.step_jobs import StepJobs
from offload.llm.llm import LLM
from tests import zoo

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=5, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 9, 14, 3, 27, 8, 11]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return zoo.save_attentive_llm(tmp_path_factory.mktemp("tiny"), num_layers=2)


@pytest.fixture
def gate(monkeypatch, tmp_path):
    """Background compiles on (the suite turns compiling off), steps kept in the test's
    own folder, and every job held until the test opens the gate (at most a minute: a
    decode loop that waited for its job would fail its test, not hang it)."""
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(cpu_step.ENV, "1")
    monkeypatch.setattr(cpu_linear, "PAYS_BYTES", 0)
    opened = threading.Event()
    kept = compiled_step.CompiledCpuStep._kept

    def held(self, step, path):
        opened.wait(60)
        return kept(self, step, path)

    monkeypatch.setattr(compiled_step.CompiledCpuStep, "_kept", held)
    return opened


def _run(llm):
    [out] = llm.generate(PROMPT, GREEDY, use_tqdm=False)
    return out.outputs[0].token_ids, out.outputs[0].logprobs


def test_steps_run_eagerly_while_the_step_compiles_then_compiled(checkpoint, gate, monkeypatch):
    llm = LLM(checkpoint, device="cpu", dtype="float32")
    eager = _run(LLM(checkpoint, device="cpu", dtype="float32", enforce_eager=True))
    assert _run(llm) == eager  # the compile held: every step eager, none waited for it
    assert llm.transfer_stats().num_compiled_steps == 0 and llm._cpu_step.compiling
    assert llm.transfer_stats().compile_s == 0  # (no step waited)
    gate.set()
    llm.wait_for_compiles()
    assert not llm._cpu_step.compiling and len(list(step_cache.folder().glob("*.pt2"))) == 1
    result = _run(llm)
    assert llm.transfer_stats().num_compiled_steps == GREEDY.max_tokens - 1
    assert result == eager  # the compiled step's bits are the eager step's (step_order)
    monkeypatch.setenv(cpu_step.ENV, "wait")
    compiled = LLM(checkpoint, device="cpu", dtype="float32")
    assert _run(compiled) == result  # the compiled step's bits
    # A later LLM of the same setting loads the kept step in the background: no trace.
    monkeypatch.setenv(cpu_step.ENV, "1")
    graphs = counters["stats"]["unique_graphs"]
    later = LLM(checkpoint, device="cpu", dtype="float32")
    _run(later)
    later.wait_for_compiles()
    assert _run(later) == result and later._cpu_step.loaded == 1
    assert counters["stats"]["unique_graphs"] == graphs


def _compile_ready_in_the_first_decode_step(llm, gate, monkeypatch) -> list:
    """Hold the compile until the first eager decode step (the first call of the eager
    step's kernels: a prefill runs in `prompt_kernels`), then let it end before that step
    runs."""
    from offload.engine.step_runner import StepRunner

    kernels, calls = StepRunner.kernels, []

    def compile_done_during_the_first_eager_step(runner):
        calls.append(1)
        if len(calls) == 1:
            gate.set()
            assert llm._cpu_step.wait(60)
        return kernels(runner)

    monkeypatch.setattr(StepRunner, "kernels", compile_done_during_the_first_eager_step)
    return calls


def test_an_answer_begun_eagerly_takes_its_step_once_ready_with_the_same_bits(
    checkpoint, gate, monkeypatch
):
    """The compiled step gives the eager step's bits (engine/step_order.py), so an answer
    begun while its step compiled takes it from the next step on, and is the eager
    answer bit for bit: tokens and logprobs."""
    eager = _run(LLM(checkpoint, device="cpu", dtype="float32", enforce_eager=True))
    llm = LLM(checkpoint, device="cpu", dtype="float32")
    calls = _compile_ready_in_the_first_decode_step(llm, gate, monkeypatch)
    assert _run(llm) == eager
    assert len(calls) == 1 and not llm._cpu_step.compiling
    assert llm.transfer_stats().num_compiled_steps == GREEDY.max_tokens - 2


def test_where_the_bits_may_differ_an_answer_begun_eagerly_ends_eagerly(
    checkpoint, gate, monkeypatch
):
    """Without the row-invariant products (no C compiler: the eager step's products are
    MKL's, the compiled step's inductor's) an answer that began while its step compiled
    runs every step eagerly even once it is ready (a switch midway made an answer depend
    on when the compile ended); the next answer runs compiled."""
    from offload.engine.step_runner import StepRunner

    monkeypatch.setattr(cpu_linear, "row_invariant", lambda model: False)
    llm, kernels = LLM(checkpoint, device="cpu", dtype="float32"), StepRunner.kernels
    calls = _compile_ready_in_the_first_decode_step(llm, gate, monkeypatch)
    _run(llm)
    assert not llm._cpu_step.compiling  # (ready from the second step on)
    assert llm.transfer_stats().num_compiled_steps == 0 and len(calls) == GREEDY.max_tokens - 1
    monkeypatch.setattr(StepRunner, "kernels", kernels)
    _run(llm)
    assert llm.transfer_stats().num_compiled_steps == GREEDY.max_tokens - 1


def _serve_one(serving) -> list:
    """One request through the server's engine (its own thread): its token ids."""
    import queue

    out = queue.Queue()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    serving.submit(None, [5, 9, 14], params, out.put)
    while not (item := out.get(timeout=60)).finished:
        assert not isinstance(item, BaseException), item
    return item.outputs[0].token_ids


def test_a_server_starts_and_serves_eagerly_while_its_steps_compile(checkpoint, gate):
    llm = LLM(checkpoint, device="cpu", dtype="float32")
    serving = llm.serving(2)
    serving.warm_up()  # (returns at once: its two steps wait at the gate)
    assert llm._cpu_step.compiling and not llm._cpu_step._steps
    assert len(_serve_one(serving)) == 4
    assert llm.transfer_stats().num_compiled_steps == 0
    gate.set()
    llm.wait_for_compiles()
    assert len(_serve_one(serving)) == 4
    assert llm.transfer_stats().num_compiled_steps == 3  # (the first token is the prefill's)
    serving.close()


def test_a_compile_that_ends_after_close_keeps_nothing(checkpoint, gate):
    llm = LLM(checkpoint, device="cpu", dtype="float32")
    _run(llm)
    step = llm._cpu_step
    assert step.compiling
    llm.close()
    gate.set()
    assert step.wait(60)
    assert not list(step_cache.folder().glob("*.pt2"))


def test_a_compile_that_fails_after_close_does_not_mark_the_step_unkeepable(
    checkpoint, gate, monkeypatch
):
    """A compile that fails because its LLM closed under it (a server stopped while its
    steps compile) leaves no mark that the step cannot be kept: the next launch compiles
    and keeps it (before, every later launch traced it again)."""

    llm = LLM(checkpoint, device="cpu", dtype="float32")
    _run(llm)  # (its compile job held at the gate)
    step = llm._cpu_step

    class ClosedUnderTheTrace:
        def __init__(self, *args, **kwargs):
            pass

        def aot_compile(self, *args, **kwargs):
            step._jobs.closed.set()  # (what `close` does, here in the middle of the trace)
            raise RuntimeError("the model was torn down under the trace")

    monkeypatch.setattr(compiled_step.torch, "compile", ClosedUnderTheTrace)
    gate.set()
    assert step.wait(60)
    assert not list(step_cache.folder().glob("*.traced"))
    assert not list(step_cache.folder().glob("*.pt2"))
    llm.close()


def test_jobs_run_once_each_and_hand_their_result_over_once():
    jobs, ran = StepJobs(), []
    opened = threading.Event()
    jobs.submit("a", lambda: (opened.wait(10), ran.append("a"), 1)[-1])
    jobs.submit("a", lambda: ran.append("again"))  # (queued already: not again)
    assert jobs.pending("a") and jobs.take("a") == (False, None)
    opened.set()
    assert jobs.wait(10) and ran == ["a"]
    assert jobs.take("a") == (True, 1) and jobs.take("a") == (False, None)
    jobs.submit("b", lambda: 1 / 0)  # a failing job: None, logged
    assert jobs.wait(10) and jobs.take("b") == (True, None)


def test_a_process_about_to_exit_waits_for_a_compile_not_for_a_load(checkpoint, gate):
    """`offload generate` waits at its end for a step still compiling (kept for the next
    run) but not for a kept one still loading (it keeps nothing new)."""
    first = LLM(checkpoint, device="cpu", dtype="float32")
    _run(first)  # its job held: compiling
    assert first._cpu_step.compiling
    assert not first._cpu_step.wait(timeout_s=0.2, loads=False)  # a compile: waited for
    gate.set()
    first.wait_for_compiles()
    assert len(list(step_cache.folder().glob("*.pt2"))) == 1
    gate.clear()
    later = LLM(checkpoint, device="cpu", dtype="float32")
    _run(later)  # its job held: loading the kept step
    assert later._cpu_step.compiling
    assert later._cpu_step.wait(timeout_s=0.2, loads=False)  # a load: not waited for
    assert not later._cpu_step.wait(timeout_s=0.2)  # (it is still loading)
    gate.set()
    later.wait_for_compiles()
    assert later._cpu_step.loaded == 1


def test_the_program_ends_without_finalizing_while_a_compile_runs(monkeypatch):
    """A daemon thread inside torch's C++ at interpreter exit aborts the process (status
    134): the `offload` program leaves by os._exit, after the exit handlers, while a job
    runs or waits; once none does, it exits as usual."""
    cli_main = importlib.import_module("offload.cli.main")

    exits, ran = [], []
    monkeypatch.setattr(cli_main.os, "_exit", exits.append)
    monkeypatch.setattr(cli_main.atexit, "_run_exitfuncs", lambda: ran.append(True))
    jobs, release = StepJobs(), threading.Event()
    jobs.submit("shape", lambda: release.wait(30))
    cli_main._leave_compiles(0)
    assert exits == [0] and ran == [True]
    release.set()
    assert jobs.wait(timeout_s=30)
    cli_main._leave_compiles(3)
    assert exits == [0]


EXITS_MID_JOB = """
import sys, time, torch
from offload.engine import step_jobs
def job():  # (inside torch's C++ most of the time, the GIL released, as inductor's compile)
    a = torch.randn(384, 384)
    end = time.monotonic() + 3
    while time.monotonic() < end:
        a = torch.mm(a, a).clamp_(-1, 1)
    return "done"
jobs = step_jobs.StepJobs()
jobs.submit("step", job)
time.sleep(0.5)
print("the answer", flush=True)
"""


def test_a_script_that_ends_mid_compile_waits_for_it_and_exits_cleanly():
    """CPython aborts a process whose daemon thread is inside torch's C++ at exit (134,
    "terminate called without an active exception"): the job is waited for, said on
    stderr, and the script's status is its own."""
    done = subprocess.run(
        [sys.executable, "-c", EXITS_MID_JOB], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-500:]
    assert done.stdout == "the answer\n"
    assert "waiting for the decode step's compile" in done.stderr
    assert "terminate" not in done.stderr
