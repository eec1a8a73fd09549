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
a handful of compiles serve every prompt. Inductor keeps what it compiled on disk, so a
second process re-traces (seconds) but does not compile again.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import types

import torch

from offload.engine.cpu_linear import LinearMode

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


def one_row_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor | None:
    """`F.linear` of a single row as `(x * weight).sum(-1)` (float32 on a CPU, plain tensors,
    under torch.compile); None where `F.linear` should run."""
    if type(weight) not in (torch.Tensor, torch.nn.Parameter) or type(x) is not torch.Tensor:
        return None
    if x.device.type != "cpu" or weight.dim() != 2 or x.numel() != x.shape[-1]:
        return None
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return None
    out = (x.reshape(1, -1) * weight).sum(-1).reshape(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


class OneRowProducts(LinearMode):
    """`F.linear` over one row as `one_row_linear` (dynamo traces the mode into the
    compiled graph)."""

    def linear(self, *args, **kwargs) -> torch.Tensor | None:
        return one_row_linear(*args, **kwargs)


def _run(step) -> torch.Tensor:
    return step()


class CompiledCpuStep:
    """`step()` of a `graphs.DecodeStep` compiled, one graph per shape (batch, cache
    length), each announced on stderr the first time this object meets it (the first
    on a machine compiles for about a minute; later ones come from inductor's cache)."""

    def __init__(self):
        # A code object of its own: dynamo keeps its compiled graphs (and counts
        # recompiles) per code object, so each LLM's steps neither meet another model's
        # guards nor use up a shared recompile limit.
        code = _run.__code__.replace()
        self._fn = torch.compile(types.FunctionType(code, _run.__globals__, "step"), dynamic=False)
        self._shapes: set[tuple[int, ...]] = set()
        self.compile_s = 0.0  # seconds of the calls that compiled, summed

    def ready(self, step) -> bool:
        """Whether `step`'s shape is compiled already (else its next call compiles)."""
        return tuple(step.mask.shape) in self._shapes

    def __call__(self, step) -> torch.Tensor:
        shape = tuple(step.mask.shape)
        if shape in self._shapes:
            with OneRowProducts():
                return self._fn(step)
        what = f"compiling the CPU decode step for batch {shape[0]}, cache {shape[1]}"
        what += " (once per machine, up to a minute)"
        started = time.perf_counter()
        try:
            with _Announced(what), OneRowProducts():
                logits = self._fn(step)
        finally:
            self.compile_s += time.perf_counter() - started
        self._shapes.add(shape)
        return logits


class _Announced:
    """A line on stderr while a compile runs: on a terminal its seconds count up in place;
    elsewhere (a log) one line before and one after."""

    def __init__(self, what: str):
        self._what = f"offload: {what}"
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
        print(
            f"\r{line:<{len(self._what) + 8}}" if self._tty else line, file=sys.stderr, flush=True
        )
