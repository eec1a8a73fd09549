"""The compiled CPU decode step (`cpu_step`'s rewrite of its products), one graph per
shape, kept on disk (`step_cache`) and compiled off the decode loop's thread
(`step_jobs`)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
import types
import weakref
from collections.abc import Callable

import torch
from torch._dynamo.utils import counters

from offload.engine import step_cache
from offload.engine.compile_options import COMPILE_OPTIONS, rewrite_digest
from offload.engine.cpu_step import ENV
from offload.engine.step_jobs import Announced, StepJobs
from offload.memory.cache_trust import check_inductor_cache

log = logging.getLogger(__name__)


def _run(step) -> torch.Tensor:
    return step()


class CompiledCpuStep:
    """`step()` of a `graphs.DecodeStep` compiled, one graph per shape (batch, cache
    length): loaded from the steps kept on disk (`step_cache`: the quickest), else compiled
    (slowest on a machine's first, quicker from inductor's cache; docs/benchmarks.md) and
    kept there. By default (`background`) a shape's load or compile runs on a thread of its
    own (`step_jobs`) while its steps run eagerly: a call gives None until it is ready.
    Where the step cannot be kept (a graph break), or with `OFFLOAD_CPU_COMPILE=wait`, the
    call that meets a shape compiles it, announced on stderr."""

    def __init__(self, background: bool | None = None):
        # A code object of its own: dynamo keeps its compiled graphs (and counts
        # recompiles) per code object, so each LLM's steps neither meet another model's
        # guards nor use up a shared recompile limit.
        code = _run.__code__.replace()
        # And globals of its own: dynamo puts each graph it compiles there by name while
        # the graph lives, so a step compiled here keeps its one name (`_graph_named`)
        # while another LLM's compile of the same step lives on in this process.
        self._function = types.FunctionType(code, dict(_run.__globals__), "step")
        self._traced_step: Callable | None = None  # (made at the first shape: `_traced`)
        self._steps: dict[tuple[int, ...], Callable] = {}
        self._jobs = StepJobs()
        self._compiling: set[tuple[int, ...]] = set()  # shapes whose job compiles (no file)
        self.background = os.environ.get(ENV, "1") != "wait" if background is None else background
        self.compile_s = 0.0  # seconds of the calls that compiled, summed (waited for)
        self.loaded = 0  # shapes loaded from disk
        self.graphs: dict[tuple[int, ...], int] = {}  # graphs each shape's step runs in

    def ready(self, step) -> bool:
        """Whether `step`'s shape is compiled already (else its next call compiles)."""
        return _key(step) in self._steps

    def blocks(self, step) -> bool:
        """Whether the next call for `step` would compile before it returns (a stream's
        lines wait for such a call: its announcement would cut them)."""
        return not self.ready(step) and not (self.background and step_cache.keepable(step))

    def usable(self, step) -> bool:
        """False once `step`'s shape is known to trace into no graph at all (dynamo gave
        up on every frame of it): its steps run eagerly, and count as eager."""
        return self.graphs.get(_key(step), 1) > 0

    @property
    def compiling(self) -> bool:
        """Whether a shape's load or compile is running on its own thread."""
        return self._jobs.pending()

    @property
    def running(self) -> threading.Lock:
        """Held while a load or compile of this step runs (`StepJobs.running`)."""
        return self._jobs.running

    @property
    def background_s(self) -> float:
        """Seconds the background loads and compiles took (no step waited for them)."""
        return self._jobs.seconds

    def wait(self, timeout_s: float | None = None, loads: bool = True) -> bool:
        """Wait for the loads and compiles in the background (so that they are kept for
        the next process); whether they ended. `loads` False: only while one compiles (a
        load keeps nothing new: a process about to exit need not wait for it)."""
        pending = [shape for shape in self._compiling if self._jobs.pending(shape)]
        if not self._jobs.pending() or (not loads and not pending):
            return True
        with Announced("keeping the compiled decode step for the next run", "compile"):
            return self._jobs.wait(timeout_s)

    def close(self) -> None:
        """The model is about to be torn down: a compile still running keeps nothing."""
        self._jobs.close()

    def __call__(self, step, checked_once: bool = False) -> torch.Tensor | None:
        """The compiled step's logits for `step`, or None while its shape compiles in the
        background (the caller runs the step eagerly). `checked_once`: the caller runs
        the same `step` object (its tensors updated in place) over weights that stay in
        place (`BaseOffloader.weights_in_place`) with nothing else running between its
        calls, so a kept step's guards, once passed for it, are not checked again (each
        check reads hundreds of tensors' metadata back from memory after the step has
        streamed the weights through the cache: docs/benchmarks.md, "2026-11-28
        (twenty-first session): the server's few-row steps, and the default model's steps
        as stored (issue 28)")."""
        shape = _key(step)
        run = self._steps.get(shape)
        if run is None and self.background and step_cache.keepable(step):
            run = self._collect(step, shape)
            if run is None:
                return None
        if run is not None:
            return run(step, checked_once) if isinstance(run, _Checked) else run(step)
        what = getattr(step, "compile_what", None) or f"batch {shape[0]}, cache {shape[1]}"
        what = f"compiling the CPU decode step for {what} (once per machine, "
        what += "up to two minutes)" if hasattr(step, "compile_key") else "up to a minute)"
        started = time.perf_counter()
        try:
            with Announced(what) as announced:
                run = self._prepare(step, shape)
                before = counters["stats"]["unique_graphs"]  # (after a failed keeping compile)
                logits = run(step)
                # A step kept on disk is one graph; a traced one may break into pieces
                # (or none: dynamo gave up), which the line on stderr says.
                made = counters["stats"]["unique_graphs"] - before
                announced.graphs = self.graphs[shape] = 1 if isinstance(run, _Checked) else made
        finally:
            self.compile_s += time.perf_counter() - started
        self._steps[shape] = run
        return logits

    def _collect(self, step, shape: tuple) -> Callable | None:
        """The shape's step once its background job is done; None while it runs (the job
        is started at the first call). A job that could not keep the step leaves it to
        the foreground: traced at the next call, as before."""
        done, kept = self._jobs.take(shape)
        if not done:
            if not self._jobs.pending(shape):
                # (the file's name from the step as it is now, on this thread: the model
                # is not mid-forward, whatever the job's trace meets later)
                check_inductor_cache()
                path = step_cache.folder() / f"{self._name(step, shape)}.pt2"
                if not path.exists():  # (compiled and kept, not loaded)
                    self._compiling.add(shape)
                self._jobs.submit(shape, functools.partial(self._kept, step, path))
            return None
        if kept is None:
            self._steps[shape] = self._trace
        else:
            self._steps[shape], self.graphs[shape] = kept, 1
        return self._steps[shape]

    @property
    def _traced(self) -> Callable:
        """The step as torch.compile traces it. Made at the first compile, whose seconds
        count it: making it checks the CPU's vector units in compiler runs (once a process;
        docs/benchmarks.md, "2026-11-27 (sixteenth session): the stored model's step
        compiled; both issues' CPU checks again"), which would else count as decoding
        time."""
        if self._traced_step is None:
            check_inductor_cache()  # (its kernels are loaded from there)
            self._traced_step = torch.compile(
                self._function, dynamic=False, options=COMPILE_OPTIONS
            )
        return self._traced_step

    def _trace(self, step) -> torch.Tensor:
        """The step as torch.compile traces it, its dynamic sizes marked (`_marked`)."""
        return self._traced(_marked(step))

    @staticmethod
    def _name(step, shape: tuple) -> str:
        return step_cache.fingerprint(step, f"{shape} {rewrite_digest()}")

    def _prepare(self, step, shape: tuple[int, ...]) -> Callable:
        """The step kept on disk for this model, setting and shape; else compiled ahead of
        time and kept; else (it cannot be: a graph break) as torch.compile traces it."""
        if not step_cache.keepable(step):
            return self._trace
        check_inductor_cache()
        kept = self._kept(step, step_cache.folder() / f"{self._name(step, shape)}.pt2")
        return self._trace if kept is None else kept

    def _kept(self, step, path) -> _Checked | None:
        """The step kept at `path`; else compiled ahead of time and kept there; None where
        it cannot be kept (then it is traced)."""
        if self._jobs.closed.is_set():  # (a job that started after its LLM closed)
            return None
        saved = step_cache.load(path)
        if saved is not None and saved.guard_check(step):
            self.loaded += 1
            return _Checked(saved, self._trace)
        unkept = path.with_suffix(".traced")  # this step cannot be kept: trace it at once
        if unkept.exists():
            return None
        _marked(step)
        options = {**COMPILE_OPTIONS, "guard_filter_fn": torch.compiler.keep_portable_guards_unsafe}
        whole = torch.compile(self._function, fullgraph=True, dynamic=False, options=options)
        try:
            with _graph_named(path.stem, self._function.__globals__):
                compiled = whole.aot_compile(((step,), {}))
        except Exception as error:  # traced as before; only slower to start
            # (A graph break, or state its guards would keep that does not pickle: the
            # offloaders' slots and locks.) Said once, so no later process tries again.
            log.info("the decode step compiles without being kept (%s)", error)
            if not self._jobs.closed.is_set():  # (else its LLM closed under it: try again)
                step_cache.mark(unkept)
            return None
        if not self._jobs.closed.is_set():  # (else the trace may have met a torn model)
            step_cache.save(compiled, path)
        compiled.disable_guard_check()
        return _Checked(compiled, self._trace)


_naming = threading.local()  # (`_graph_named`: the name of the graph this thread compiles)
_naming_lock = threading.Lock()
_PREFIX = "__compiled_fn"  # (what dynamo names a compiled graph's global after)


@contextlib.contextmanager
def _graph_named(name: str, scope: dict):
    """Compile with dynamo naming the graph after `name` (the step's fingerprint), not a
    counter and a random uuid: AOTAutograd's cache key holds that name for a step compiled
    ahead of time (`aot_compile`), so no later compile of the same graph ever hit the
    cache of AOTAutograd and inductor (measured: a 3-layer model's step, 10.2 s to
    compile, 5.4 s with a hit; docs/benchmarks.md). dynamo puts the graph in `scope`, the
    traced function's globals, under that name while it lives: each `CompiledCpuStep` has
    globals of its own, so a name is taken again only by a second compile of the same
    step in the same one (then `name_2`). Other threads' compiles keep dynamo's names;
    without the hook (another torch) nothing changes but the time."""
    from torch._dynamo import output_graph

    with _naming_lock:
        taken, count = name, 1
        while f"{_PREFIX}_{name}" in scope:
            count += 1
            name = f"{taken}_{count}"
        original = getattr(output_graph, "unique_id", None)
        if original is not None and not hasattr(original, "offload_named"):

            def unique_id(prefix: str, *args, **kwargs) -> str:
                named = getattr(_naming, "name", None)
                if named is not None and prefix == _PREFIX:
                    return f"{prefix}_{named}"
                return original(prefix, *args, **kwargs)

            unique_id.offload_named = True
            output_graph.unique_id = unique_id
    _naming.name = name
    try:
        yield
    finally:
        _naming.name = None


def _marked(step):
    """`step` with its dynamic sizes marked (`dynamic_dims`: `rows.RowStep`'s,
    `packed_step.PackedStep`'s), for a call that may compile. Only such calls: a kept
    step's guards are rebuilt from tensors that lost their marks, and refuse a marked input
    (an unmarked one passes the marked graph's)."""
    for tensor, dims in step.dynamic_dims() if hasattr(step, "dynamic_dims") else ():
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
    return step


def _key(step) -> tuple:
    """What a step's graph is specialised to: its mask's shape (batch, cache length), or
    the step's own `compile_key` (a step of dynamic sizes, `rows.RowStep`); and the ids of
    the KV offloaders its cache's layers name, which the graph holds as constants (a call's
    KV offloader may get another id than the last call's, while that one's offloader lives
    on or another `LLM`'s holds it: the old graph would name a missing or foreign one)."""
    key = getattr(step, "compile_key", None)
    key = key if key is not None else tuple(step.mask.shape)
    ids = sorted(
        {layer.offloader_id for layer in _cache_layers(step) if hasattr(layer, "offloader_id")}
    )
    return (*key, *(("kv", *ids) if ids else ()))


def _cache_layers(step) -> list:
    layers = []
    for cache in step._cache.values():
        inner = getattr(cache, "self_attention_cache", cache)  # (an encoder-decoder's)
        layers += list(getattr(inner, "layers", ()))
    return layers


class _Checked:
    """A step compiled ahead of time, called where its guards hold for the step's inputs
    (their sizes, strides and dtypes), else the step as torch.compile traces it."""

    def __init__(self, compiled, traced: Callable):
        self._compiled = compiled
        self._traced = traced
        self._passed: weakref.ref | None = None  # the step object whose guards passed
        self.guard_checks = 0  # (counted for the tests)

    def __call__(self, step, checked_once: bool = False) -> torch.Tensor:
        if checked_once and self._passed is not None and self._passed() is step:
            return self._compiled(step)  # (`CompiledCpuStep.__call__` says when)
        self.guard_checks += 1
        if self._compiled.guard_check(step):
            self._passed = weakref.ref(step) if checked_once else None
            return self._compiled(step)
        self._passed = None
        return self._traced(step)
