"""Several engine cores as one engine (vLLM's virtual engines): over a pipeline each core
is a micro-batch with its own rows, scheduler and thread, and a core's forward lets go of
rank 0 once its stage has run (`Pipeline.run`), so while the other ranks work on one
core's micro-batch, rank 0 runs the next core's: every stage is busy. `MicroBatches` is
what `Serving`, the server and `generate` see: one engine, the cores' requests, counts
and errors together; a request runs on the core with the least work
(`llm.cores` makes them)."""

from __future__ import annotations

import atexit
import functools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from offload.engine.core import EngineCore
from offload.engine.requests import Submitted


class MicroBatches:
    """`cores` (made with `own_thread=False`) as one engine: each core's loop in a thread
    of its own (`own_thread`), else the first in the caller's (`run`), the rest in theirs."""

    def __init__(self, cores: list[EngineCore], own_thread: bool = True):
        self.cores = cores
        self._on_step: Callable[[], None] | None = None
        self._stepping = threading.Lock()  # (each core calls `on_step` from its thread)
        self._threads: list[threading.Thread] = []
        self._at_exit: Callable[[], None] | None = None
        self._closed = False
        if own_thread:
            self._start(cores)

    def _start(self, cores: list[EngineCore]) -> None:
        for core in cores:
            thread = threading.Thread(target=core.run, name="offload-engine", daemon=True)
            thread.start()
            self._threads.append(thread)
        if self._at_exit is None:  # (as `EngineCore`: no daemon thread left inside torch)
            self._at_exit = functools.partial(_close_at_exit, weakref.ref(self))
            atexit.register(self._at_exit)

    # -- what `Serving` and the server see (`EngineCore`'s names) --------------------

    def submit_all(self, requests: list[Submitted]) -> None:
        """Each request to the core with the least work (running and waiting, counting
        those given out in this call), queued at once per core."""
        load = [core.num_running + core.num_waiting for core in self.cores]
        given: list[list[Submitted]] = [[] for _ in self.cores]
        for request in requests:
            index = min(range(len(self.cores)), key=lambda i: (load[i], i))
            load[index] += 1
            given[index].append(request)
        for core, requests_here in zip(self.cores, given, strict=True):
            if requests_here:
                core.submit_all(requests_here)

    def cancel(self, request: Submitted) -> None:
        for core in self.cores:  # (the flag is the request's: the core holding it stops it)
            core.cancel(request)

    @property
    def num_running(self) -> int:
        return sum(core.num_running for core in self.cores)

    @property
    def num_waiting(self) -> int:
        return sum(core.num_waiting for core in self.cores)

    @property
    def max_rows(self) -> int:
        return sum(core.max_rows for core in self.cores)

    @property
    def max_len(self) -> int:
        return self.cores[0].max_len

    @property
    def last_error(self) -> BaseException | None:
        errors = [core.last_error for core in self.cores if core.last_error is not None]
        return errors[0] if errors else None

    @property
    def scheduler(self) -> Schedulers:
        return Schedulers([core.scheduler for core in self.cores])

    @property
    def on_step(self) -> Callable[[], None] | None:
        return self._on_step

    @on_step.setter
    def on_step(self, call: Callable[[], None] | None) -> None:
        self._on_step = call
        for core in self.cores:
            core.on_step = None if call is None else self._stepped

    def _stepped(self) -> None:
        with self._stepping:
            if self._on_step is not None:
                self._on_step()

    def drain(self) -> None:
        """Every core's turns until its requests are done (`generate`): the first core's
        on the caller's thread, the others' on threads of theirs, so their forwards are
        in flight together. Interrupted, the others stop at their next turn first."""
        stop = threading.Event()
        threads = [
            threading.Thread(target=core.drain, args=(stop,), name="offload-engine", daemon=True)
            for core in self.cores[1:]
        ]
        for thread in threads:
            thread.start()
        try:
            self.cores[0].drain()
        except BaseException:  # (Ctrl-C: the others stop at their next turn)
            stop.set()
            raise
        finally:
            try:
                for thread in threads:
                    thread.join()
            except BaseException:  # (Ctrl-C while they finish: stopped, then waited for)
                stop.set()
                for thread in threads:
                    thread.join()
                raise

    def abandon(self, error: BaseException) -> None:
        for core in self.cores:
            core.abandon(error)

    def warm_up(self) -> None:
        for core in self.cores:
            core.warm_up()

    def run(self) -> None:
        """The cores' loops until `close`: the first on the caller's thread."""
        self._start(self.cores[1:])
        self.cores[0].run()

    def close(self, timeout_s: float = 10.0) -> None:
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
        for core in self.cores:
            core.close(timeout_s)
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current:
                thread.join(timeout=timeout_s)


def _close_at_exit(ref: weakref.ref[MicroBatches]) -> None:
    group = ref()
    if group is not None:
        group.close()


@dataclass
class _Prefixes:
    queries: int
    hits: int


class Schedulers:
    """The cores' schedulers' figures together (what `/metrics` and serve's first line
    read of one scheduler)."""

    def __init__(self, schedulers: list):
        self._schedulers = schedulers

    @property
    def room(self) -> int | None:
        rooms = [s.room for s in self._schedulers]
        return None if any(room is None for room in rooms) else sum(rooms)

    @property
    def prefixes(self) -> _Prefixes | None:
        held = [s.prefixes for s in self._schedulers if s.prefixes is not None]
        if not held:
            return None
        return _Prefixes(sum(p.queries for p in held), sum(p.hits for p in held))

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self._schedulers)

    @property
    def kv_usage(self) -> float:
        """The part of all the rooms held (each core's room is an equal share)."""
        return sum(s.kv_usage for s in self._schedulers) / len(self._schedulers)
