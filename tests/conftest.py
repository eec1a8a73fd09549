import contextlib
import functools
import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import weakref

# Before torch starts OpenMP: its idle workers then sleep instead of spinning, so a test
# run beside another CPU-heavy process (or a test's own copy thread) is not slowed 10-100x
# on a 2-core machine. Outputs do not depend on it; a user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The compiled CPU decode step (engine/cpu_step.py) costs ~8 s of tracing per LLM even
# with inductor's cache warm, for the float32 default model of most LLM tests (and their
# subprocesses): off here, on in tests/engine/test_cpu_step.py, which tests it.
os.environ["OFFLOAD_CPU_COMPILE"] = "0"

import interrupts
import pytest
import tiers
import torch
from hypothesis import settings

from offload.offloader.base import NoopOffloader, set_offloader

# No per-example deadline: on a loaded 2-core machine a fast example can take a second, and
# a deadline would then fail (or call "flaky") a test that found nothing wrong.
settings.register_profile("offload", deadline=None)
settings.load_profile("offload")


def pytest_configure(config):
    """The suite's own cache folder (the default model converted, the planner's
    measurements), new for each session: it never reads or writes the user's cache, so its
    results and its time do not depend on what an earlier run left there. Set before any
    test or fixture runs, and inherited by the commands that tests start."""
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the session's folder
        config.offload_cache_dir = config.workerinput["offload_cache_dir"]
        config.offload_user_cache_dir = config.workerinput["offload_user_cache_dir"]
        os.environ["OFFLOAD_CACHE_DIR"] = config.offload_cache_dir
        _freeze_the_modules()
        return
    if not config.getoption("numprocesses", None):  # (tests run in this process)
        _freeze_the_modules()
    config.offload_cache_dir = tempfile.mkdtemp(prefix="offload-test-cache-")
    config.offload_user_cache_dir = os.environ.get("OFFLOAD_CACHE_DIR")
    os.environ["OFFLOAD_CACHE_DIR"] = config.offload_cache_dir
    # The default model is converted in the background while the first tests run (to
    # float32, then laid out as stored, as `LLM()` runs it on a CPU): a test that needs
    # either waits on its conversion's lock, instead of a worker converting while the other
    # one waits idle. If it fails, the fixture converts and reports why.
    convert = (
        "from offload.model.default import default_model_path; default_model_path(); "
        "from offload.model.sources import resolve_model; "
        "from offload.probes.layout_choice import LayoutChooser; "
        "resolve_model(None, quantization='gguf', layout_chooser=LayoutChooser); "
        "from offload.quant.row_dot import library; library()"  # (its C, built once)
    )
    if "not slow" not in (config.getoption("markexpr", "") or ""):  # (slow tests use it)
        convert += (
            f"; import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
            "import short_model; short_model.prepare()"  # (the cut model: short_model.py)
        )
    config.offload_converting = subprocess.Popen(
        [sys.executable, "-c", convert],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _freeze_the_modules() -> None:
    """The modules the tests import (torch's, its compilers', transformers', ours: ~450k
    objects that live as long as the process) frozen out of Python's full collections,
    which otherwise scan them every time: the collections that measure memory
    (`reset_peak_rss`, the planner's) and Python's own took ~100 s of the suite's CPU."""
    import torch._dynamo
    import torch._inductor.compile_fx  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    import offload.llm  # noqa: F401

    gc.collect()
    gc.freeze()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist: every worker shares the session's cache folder (the default model is
    converted once, under its lock)."""
    node.workerinput["offload_cache_dir"] = node.config.offload_cache_dir
    node.workerinput["offload_user_cache_dir"] = node.config.offload_user_cache_dir


def pytest_unconfigure(config):
    folder = getattr(config, "offload_cache_dir", None)
    if folder is None or hasattr(config, "workerinput"):
        return
    config.offload_converting.kill()  # (done by now, unless the session was short)
    config.offload_converting.wait()
    if config.offload_user_cache_dir is None:
        os.environ.pop("OFFLOAD_CACHE_DIR", None)
    else:
        os.environ["OFFLOAD_CACHE_DIR"] = config.offload_user_cache_dir
    shutil.rmtree(folder, ignore_errors=True)


# Modules of long tests, run first: with two workers the run ends on short tests instead of
# one worker finishing the README's commands alone (collection order puts tests/test_*.py
# last). Each module stays whole, its fixtures shared as before.
_LONG_FIRST = (
    "offloader/test_prefetch.py",
    "test_fault_injection.py",
    "test_fault_injection_disk.py",
    "test_readme.py",
    "server/test_load.py",
    "bench/test_run.py",
    "engine/test_cpu_step.py",
    "engine/test_cpu_step_halves.py",
    "engine/test_step_jobs.py",
)  # fmt: skip  (those needing no default model first: it is still converting then)


# The modules of more than ~10 s of tests each (2026-11-27, `--durations=0`): marked `slow`,
# so that `pytest -m "not slow"` is a quick subset (under 2 minutes on 2 cores) of the rest.
_SLOW = (
    "test_readme.py", "llm/test_llm.py", "bench/test_run.py", "model/test_gguf_stored.py",
    "test_fault_injection.py", "llm/test_threads.py", "offloader/test_prefetch.py",
    "test_fault_injection_disk.py", "cli/test_cli.py", "model/test_loader.py",
    "server/test_load.py", "model/test_untrusted.py", "offloader/test_disk_tier.py",
    "planner/test_fit.py", "server/test_openai_server.py", "llm/test_dropped.py",
    "model/test_default_model.py", "engine/test_cpu_step.py", "engine/test_step_jobs.py",
    "engine/test_cpu_step_halves.py", "llm/test_batch_invariance.py", "cli/test_serve_signals.py",
    # (2026-11-29: the quick subset had grown to 2:39)
    "model/test_gguf_convert.py", "model/test_gguf_archs.py", "llm/test_prefill_alone.py",
    "bench/test_cli_bench.py", "probes/test_measure.py", "cli/test_plan.py",
    "model/test_sources.py", "server/test_hostile_requests.py",
    # (2026-11-29: structured outputs' schemas over the default model)
    "server/test_structured_outputs.py", "llm/test_structured_outputs.py",
    "server/test_tools.py",  # (2026-11-29: tool calls over the default model, ~1 min)
    "llm/test_preemption.py",  # (2026-11-29: 32 requests alone and preempted, ~40 s)
    "llm/test_speculative_sampling.py",  # (2026-11-30: 20k draws each way, ~25 s)
    "llm/test_speculative_tree.py",  # (2026-11-30: trees over three backends, ~2 min)
    "llm/test_speculative.py",  # (2026-11-30: speculation over four backends, ~2 min)
    "distributed/test_pipeline.py",  # (2026-11-30: pipeline ranks as processes, ~70 s)
    "distributed/test_micro_batches.py",  # (2026-11-30: micro-batches over ranks, ~90 s)
    "server/test_replicas.py",  # (2026-11-30: two replicas and a front, ~50 s)
    # (2026-12-01: the quick subset had grown to 2:51)
    "llm/test_invariant_by_default.py",  # (~110 s: every form, held prefixes, 70 rows)
    "engine/test_step_order.py",  # (~20 s: compiled steps against eager ones)
    # (2026-12-01, an AMD machine: the quick subset at 2:00)
    "server/test_second_launch.py",  # (~35 s: a server started twice)
    "engine/test_step_order_archs.py",  # (~28 s: compiled steps of five architectures)
)  # fmt: skip


def pytest_sessionstart(session):
    interrupts.install()  # (after pytest's own hook, which it wraps: set at configure)


def pytest_collection_finish(session):
    """What the imports and the collection made lives as long as the run: frozen, the
    collector no longer walks it at every full collection (~1.5% of a run's time)."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(wrapper=True)
def _end_of_phase(item):
    """A Ctrl-C that CPython dropped during the phase (tests/interrupts.py) ends the run."""
    try:
        return (yield)
    finally:
        interrupts.raise_if_dropped()


pytest_runtest_setup = pytest_runtest_call = pytest_runtest_teardown = _end_of_phase


@pytest.hookimpl(tryfirst=True)
def pytest_keyboard_interrupt(excinfo):
    interrupts.cut_lineless_frames(excinfo.value)  # (before the terminal's report of it)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        path = item.path.as_posix()
        return next((i for i, tail in enumerate(_LONG_FIRST) if path.endswith(tail)), 99)

    items.sort(key=rank)  # (stable: the rest keep their order)
    for item in items:
        if item.path.as_posix().endswith(_SLOW):
            item.add_marker(pytest.mark.slow)
        if tiers.soaked(item.nodeid):
            item.add_marker(pytest.mark.soak)
            item.add_marker(pytest.mark.slow)  # (so `-m "not slow"` leaves them out too)
    _leave_the_soak_tier(config, items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _leave_the_soak_tier(config, items) -> None:
    """A plain run leaves out the soak tier (tests/tiers.py); `-m` (any expression: `-m
    soak` runs it alone) or a test named by its id (`path::name`) runs what it selects."""
    if config.getoption("markexpr", "") or any("::" in arg for arg in config.args):
        return
    tests = config.rootpath / "tests"
    if [config.rootpath / arg for arg in config.args] == [tests]:  # (the whole suite: every
        # entry must still name a test, else it is stale)
        stale = [e for e in tiers.SOAK if not any(tiers.soaked_by(i.nodeid, e) for i in items)]
        if stale:
            raise pytest.UsageError(f"tests/tiers.py names tests that do not exist: {stale}")
    kept = [item for item in items if "soak" not in item.keywords]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if "soak" in i.keywords])
        items[:] = kept


@pytest.fixture
def ctrl_c_raises():
    """A SIGINT raises KeyboardInterrupt in this test, also where the run started with it
    ignored (a shell's background job starts so, and Python then leaves it ignored: these
    tests failed in a run started with `&`)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(autouse=True)
def _reset_global_offloader():
    yield
    set_offloader(NoopOffloader())


@pytest.fixture(autouse=True)
def _llms_closed_after_their_test(monkeypatch):
    """Every `LLM` a test makes is closed once it ends: an LLM whose serving core's thread
    still runs stays alive, with its rows' address space (VmData grew to 278 GiB over
    tests/llm/test_speculative.py), and past the RAM a heuristic overcommit then refused
    a later test's fork in the same worker (tests/llm/test_fork.py)."""
    from offload.llm.llm import LLM

    made: list = []  # (weakly: a test that drops an LLM sees it collected)
    init = LLM.__init__

    @functools.wraps(init)
    def tracked(self, *args, **kwargs):
        made.append(weakref.ref(self))
        init(self, *args, **kwargs)

    monkeypatch.setattr(LLM, "__init__", tracked)
    yield
    for ref in reversed(made):
        llm = ref()
        if llm is not None:
            with contextlib.suppress(Exception):  # (one a test broke on purpose, or half-made)
                llm.close()
        del llm


@pytest.fixture(scope="session")
def smollm2_path():
    from offload.model.default import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def short_gguf():
    """The default model cut to its first 4 blocks, as stored (tests/short_model.py)."""
    import short_model

    return short_model.short_gguf()


@pytest.fixture(scope="session")
def short_path(short_gguf):
    """The cut model's float32 folder (as `smollm2_path` is the whole model's)."""
    from offload.model.sources import resolve_model

    return resolve_model(short_gguf)


@pytest.fixture(scope="module")
def plain(short_path):
    """The float32 cut model's own answers, resident and without speculation, each
    computed once per module (`references.References`)."""
    from references import References

    references = References(short_path)
    yield references
    references.close()


@pytest.fixture(autouse=True)
def _copy_thread_protocol(monkeypatch):
    """Tests run the CPU copies on a copy thread, as if torch left a core free: the thread
    protocol (issue order, waits, late copies, interrupts) is the subtle one, and this
    2-core machine would otherwise copy on the compute thread, where ordering is trivial.
    tests/offloader/test_cpu_defaults.py and the command-line tests (subprocesses) cover
    the default engine choice."""
    from offload.memory import copy_engine

    monkeypatch.setattr(copy_engine, "available_cores", lambda: torch.get_num_threads() + 1)
