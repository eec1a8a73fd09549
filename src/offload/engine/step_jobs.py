"""Compiling CPU decode steps on a thread of their own, so that no token waits for one.

A step's compile (or the load of a kept one) takes from a few seconds to minutes: tracing
the model, inductor's C++ compiles. The decode loop asks for a step's shape, gets nothing
while its job runs, and decodes that step eagerly; once the job is done, its next steps
run compiled. The jobs of one `CompiledCpuStep` run one after another on one daemon
thread: two compiles at once would only share the cores. At the interpreter's exit a
running job is waited for (`finish_at_exit`: CPython would abort the process otherwise);
the `offload` command ends without it, and a kept step is written whole or not at all
(`step_cache.save`).

Whether the model a job traced was whole: `close()` is called before its model is torn
down, and a job that finishes after it keeps nothing (a trace may have read the model
while it was being taken apart; its step must not be kept under the intact model's name).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Hashable

import torch

log = logging.getLogger(__name__)

_SWITCH_S = 1e-5  # the GIL's switch interval while a job runs
_ALL: weakref.WeakSet = weakref.WeakSet()  # every StepJobs, for `busy`
_EXITING = threading.Event()  # the interpreter exits: queued jobs do not start


def busy() -> bool:
    """Whether a job is running or queued in any `StepJobs` of the process."""
    return any(jobs._pending for jobs in list(_ALL))


def finish_at_exit() -> None:
    """At the interpreter's exit, wait for a running compile to end (queued ones do not
    start): CPython ends a daemon thread that is inside torch's C++ by aborting the
    process (status 134, "terminate called without an active exception"), after a
    script's answers were out. Ctrl-C ends the wait, and the process, at once (status
    130). The `offload` command ends itself instead (`cli.main._leave_compiles`)."""
    _EXITING.set()
    if not busy():
        return
    print(
        "offload: waiting for the decode step's compile to end before exiting "
        "(Ctrl-C: exit now, the step is not kept)",
        file=sys.stderr,
        flush=True,
    )
    try:
        for jobs in list(_ALL):
            jobs.wait()
    except KeyboardInterrupt:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(130)


atexit.register(finish_at_exit)


class StepJobs:
    """Jobs by key (a step's shape), run in turn on one daemon thread; each one's result
    is collected by the thread that asked for it."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._results: dict[Hashable, object] = {}
        self._pending: set[Hashable] = set()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        # Held while a job runs: its trace reads the model's attention implementation,
        # which a mixed forward swaps for its own (`mixed_step.mixing`, which waits for
        # no job: its turn runs apart instead).
        self.running = threading.Lock()
        self.closed = threading.Event()
        self.seconds = 0.0  # spent in jobs, summed (none of it waited for)
        _ALL.add(self)

    def submit(self, key: Hashable, job: Callable[[], object]) -> None:
        """Run `job()` for `key` unless it is running, queued or done."""
        with self._lock:
            if key in self._pending or key in self._results:
                return
            self._pending.add(key)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._work, name="offload-step-compile", daemon=True
                )
                self._thread.start()
        self._jobs.put((key, job))

    def take(self, key: Hashable) -> tuple[bool, object]:
        """(True, result) once `key`'s job is done (the result is handed over once),
        else (False, None)."""
        with self._lock:
            if key in self._results:
                return True, self._results.pop(key)
        return False, None

    def pending(self, key: Hashable | None = None) -> bool:
        """Whether `key`'s job (any job, for None) is queued or running."""
        with self._lock:
            return bool(self._pending) if key is None else key in self._pending

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for every job queued; whether they all ended."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._idle:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self) -> None:
        """The model is about to be torn down: jobs not yet done keep nothing."""
        self.closed.set()

    def _work(self) -> None:
        while True:
            key, job = self._jobs.get()
            started = time.perf_counter()
            # While a job runs (Python, mostly: dynamo's trace), the decode loop's thread
            # takes the GIL back after each torch call; at Python's default 5 ms interval
            # it waited up to a whole interval a call, and an eager step of the default
            # model beside a compile took hundreds of times as long (docs/benchmarks.md).
            interval = sys.getswitchinterval()
            sys.setswitchinterval(_SWITCH_S)
            try:
                # (the inputs were made in inference mode: a step's guards check their
                # dispatch keys, and the mode is a thread's own)
                with torch.inference_mode(), self.running:
                    stop = self.closed.is_set() or _EXITING.is_set()
                    result = None if stop else job()
            except Exception as error:  # the step stays eager; only slower
                log.info("the decode step's compile failed (%s); it runs eagerly", error)
                result = None
            finally:
                sys.setswitchinterval(interval)
            with self._idle:
                self.seconds += time.perf_counter() - started
                self._pending.discard(key)
                self._results[key] = result
                self._idle.notify_all()


class Announced:
    """A line on stderr while a compile (or a wait for one) runs: on a terminal its
    seconds count up in place; elsewhere (a log) one line before and one after."""

    def __init__(self, what: str, done: str = "decode step"):
        self._what = f"offload: {what}"
        self._done_what = done
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
        line = f"offload: {self._done_what} {ended} in {self._seconds():.1f} s"
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
