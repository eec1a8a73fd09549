"""The decode step of one sequence on a CPU, compiled (inductor), with each linear of its
one row written as a multiply and a sum.

Eagerly a step of the default model in float32 spends ~17 ms in its products (at the read
rate, `cpu_linear`) and ~19 ms in the ~1,200 other ATen calls and the Python of
transformers' modules around them. Compiled, those fuse into a few C++ loops; and where
inductor would call MKL's one-thread matrix-vector product for `F.linear`, the product
written as `(x * weight).sum(-1)` becomes one generated loop over the weight's rows,
split across the OpenMP threads, which reads each weight once at the memory's rate
(measured on the 2-core AVX2 machine: eager 16 tok/s, compiled as it is 19, compiled with
the products so written 41; llama.cpp on the same float32 bytes 52).

Each output element is one row's sum in that loop, so the bits depend on the kernel, not on
where the weight lives: a compiled step offloaded (prefetch slots, the disk tier) gives
the same bits as the compiled step resident. They may differ from the eager step's.

The graph is specialised to its shapes (`dynamic=False`: kernels with constant sizes); the
cache's length is one of them, so `LLM` rounds it up to a power of two (`cache_length`):
a handful of compiles serve every prompt. Each step is compiled ahead of time and kept on
disk (`step_cache`): a second process loads it in ~2 s instead of tracing it again (~7 s).
Steps offloaded by prefetch or the disk tier are kept too (their hooks name the
offloader by id, `ops.register`). Where a step cannot be kept (a graph break: KV offload;
module units' read checks in its guards) dynamo traces it in each process, and inductor's
own cache spares the compile.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

from offload.engine import cpu_linear, step_attention, step_cache, step_linears
from offload.engine.step_attention import rewrite_attention
from offload.engine.step_linears import step_products
from offload.model.quantized import Int4Linear, Q8Linear

log = logging.getLogger(__name__)

MIN_CACHE_LENGTH = 128  # the smallest cache a compiled step is built for
ENV = "OFFLOAD_CPU_COMPILE"  # "0": every CPU decode step eager, as enforce_eager (the suite's)


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def cache_length(length: int, max_model_len: int) -> int:
    """The static cache's length for a compiled step of `length` positions: the next
    power of two (at least `MIN_CACHE_LENGTH`), never past `max_model_len`, never short."""
    rounded = MIN_CACHE_LENGTH
    while rounded < length:
        rounded *= 2
    return max(length, min(rounded, max_model_len))


def pays(model: torch.nn.Module) -> bool:
    """Whether a compiled step pays for `model`: where its float32 linears are large enough
    that a step is their reading (`cpu_linear.pays`), or where its bfloat16 and float16
    linears (written out as the float32 ones are, `step_linears`), or its int4 and q8
    weights kept as stored, would be as large in float32 (stored products stay opaque
    ops, the rest of the step fuses around them; a q8 product of one row becomes one loop,
    `quant_layouts.q8_one_row`). Measured on the 2-core machine, the default model as
    stored: eager 43.5 tok/s, compiled 71.1."""
    if cpu_linear.pays(model):
        return True
    halves = (torch.bfloat16, torch.float16)
    counted = (
        m
        for m in model.modules()
        if isinstance(m, (Int4Linear, Q8Linear))
        or (type(m) is torch.nn.Linear and m.weight.dtype in halves)
    )
    floats = sum(m.in_features * m.out_features * 4 for m in counted)
    return floats >= cpu_linear.PAYS_BYTES


class _ProductsPass(CustomGraphPass):
    """`step_products` and `step_attention.rewrite_attention` as inductor's pass over
    dynamo's graph (before autograd)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        # (counted beside dynamo's own counters: what a compile wrote out, for the tests)
        counters["offload"]["products_rewritten"] += step_products(graph)
        counters["offload"]["attention_rewritten"] += rewrite_attention(graph)

    def uuid(self) -> str:
        return rewrite_digest()


@functools.cache
def rewrite_digest() -> str:
    """The rewrite's source: inductor's cache keys and the saved steps' names hold it."""
    source = inspect.getsource(step_linears) + inspect.getsource(step_attention)
    return hashlib.sha256(source.encode()).hexdigest()


# (Without inductor's checks of its buffers' sizes, strides and alignment in the step's
# wrapper: ~1,100 Python calls a step, 4% of it at batch 1. The guards check the inputs.)
_OPTIONS = {
    "pre_grad_custom_pass": _ProductsPass(),
    "size_asserts": False,
    "alignment_asserts": False,
}


def _run(step) -> torch.Tensor:
    return step()


class CompiledCpuStep:
    """`step()` of a `graphs.DecodeStep` compiled, one graph per shape (batch, cache
    length), each announced on stderr the first time this object meets it: loaded from
    the steps kept on disk (`step_cache`, ~2 s), else compiled (about a minute on a
    machine's first, ~7 s more from inductor's cache) and kept there."""

    def __init__(self):
        # A code object of its own: dynamo keeps its compiled graphs (and counts
        # recompiles) per code object, so each LLM's steps neither meet another model's
        # guards nor use up a shared recompile limit.
        code = _run.__code__.replace()
        self._function = types.FunctionType(code, _run.__globals__, "step")
        self._traced_step: Callable | None = None  # (made at the first shape: `_traced`)
        self._steps: dict[tuple[int, ...], Callable] = {}
        self.compile_s = 0.0  # seconds of the calls that compiled, summed
        self.loaded = 0  # shapes loaded from disk
        self.graphs: dict[tuple[int, ...], int] = {}  # graphs each shape's step runs in

    def ready(self, step) -> bool:
        """Whether `step`'s shape is compiled already (else its next call compiles)."""
        return _key(step) in self._steps

    def usable(self, step) -> bool:
        """False once `step`'s shape is known to trace into no graph at all (dynamo gave
        up on every frame of it): its steps run eagerly, and count as eager."""
        return self.graphs.get(_key(step), 1) > 0

    def __call__(self, step, checked_once: bool = False) -> torch.Tensor:
        """The compiled step's logits for `step`. `checked_once`: the caller runs the same
        `step` object (its tensors updated in place) over weights that stay in place
        (`BaseOffloader.weights_in_place`) with nothing else running between its calls,
        so a kept step's guards, once passed for it, are not checked again (measured:
        1.2-1.4 ms a step, ~500 tensors' metadata read back from memory after the step has
        streamed the weights through the cache)."""
        shape = _key(step)
        run = self._steps.get(shape)
        if run is not None:
            return run(step, checked_once) if isinstance(run, _Checked) else run(step)
        what = getattr(step, "compile_what", None) or f"batch {shape[0]}, cache {shape[1]}"
        what = f"compiling the CPU decode step for {what} (once per machine, "
        what += "up to two minutes)" if hasattr(step, "compile_key") else "up to a minute)"
        started = time.perf_counter()
        try:
            with _Announced(what) as announced:
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

    @property
    def _traced(self) -> Callable:
        """The step as torch.compile traces it. Made at the first compile, whose seconds
        count it: making it checks the CPU's vector units in ~11 compiler runs (~1 s, once
        a process), which would else count as decoding time."""
        if self._traced_step is None:
            self._traced_step = torch.compile(self._function, dynamic=False, options=_OPTIONS)
        return self._traced_step

    def _trace(self, step) -> torch.Tensor:
        """The step as torch.compile traces it, its dynamic sizes marked (`_marked`)."""
        return self._traced(_marked(step))

    def _prepare(self, step, shape: tuple[int, ...]) -> Callable:
        """The step kept on disk for this model, setting and shape; else compiled ahead of
        time and kept; else (it cannot be: a graph break) as torch.compile traces it."""
        if not step_cache.keepable(step):
            return self._trace
        name = step_cache.fingerprint(step, f"{shape} {rewrite_digest()}")
        path = step_cache.folder() / f"{name}.pt2"
        saved = step_cache.load(path)
        if saved is not None and saved.guard_check(step):
            self.loaded += 1
            return _Checked(saved, self._trace)
        unkept = path.with_suffix(".traced")  # this step cannot be kept: trace it at once
        if unkept.exists():
            return self._trace
        _marked(step)
        options = {**_OPTIONS, "guard_filter_fn": torch.compiler.keep_portable_guards_unsafe}
        whole = torch.compile(self._function, fullgraph=True, dynamic=False, options=options)
        try:
            compiled = whole.aot_compile(((step,), {}))
        except Exception as error:  # traced as before; only slower to start
            # (A graph break, or state its guards would keep that does not pickle: the
            # offloaders' slots and locks.) Said once, so no later process tries again.
            log.info("the decode step compiles without being kept (%s)", error)
            step_cache.mark(unkept)
            return self._trace
        step_cache.save(compiled, path)
        compiled.disable_guard_check()
        return _Checked(compiled, self._trace)


def _marked(step):
    """`step` with its dynamic sizes marked (`rows.RowStep.mark_dynamic`), for a call that
    may compile. Only such calls: a kept step's guards are rebuilt from tensors that lost
    their marks, and refuse a marked input (an unmarked one passes the marked graph's)."""
    if hasattr(step, "mark_dynamic"):
        step.mark_dynamic()
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


class _Announced:
    """A line on stderr while a compile runs: on a terminal its seconds count up in place;
    elsewhere (a log) one line before and one after."""

    def __init__(self, what: str):
        self._what = f"offload: {what}"
        self.graphs = 1  # what it compiled into (said when not one)
        self._tty = sys.stderr.isatty()
        self._done = threading.Event()
        self._clock = threading.Thread(target=self._tick, name="offload-compile-clock", daemon=True)

    def __enter__(self):
        self._started = time.perf_counter()
        if self._tty:
            self._clock.start()
        else:
            print(f"{self._what}...", file=sys.stderr, flush=True)
        return self

    def _tick(self) -> None:
        while not self._done.wait(1.0):
            print(f"\r{self._what}: {self._seconds():.0f} s", end="", file=sys.stderr, flush=True)

    def _seconds(self) -> float:
        return time.perf_counter() - self._started

    def __exit__(self, kind, *_):
        self._done.set()
        if self._clock.is_alive():
            self._clock.join()
        ended = "stopped" if kind is not None else "ready"
        line = f"offload: decode step {ended} in {self._seconds():.1f} s"
        if kind is None and self.graphs != 1:
            line += (
                f", in {self.graphs} graphs: its trace broke"
                if self.graphs
                else ", but nothing compiled: its trace failed, and it runs eagerly"
            )
            line += " (TORCH_LOGS=graph_breaks says why)"
        print(
            f"\r{line:<{len(self._what) + 8}}" if self._tty else line, file=sys.stderr, flush=True
        )
