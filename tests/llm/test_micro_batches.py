"""`MicroBatches`, the engine serving sees over a pipeline's several cores: requests to
the least loaded core, counts and errors together, each core's loop in its own thread
(the first in the caller's, where it runs the loop), all stopped by `close`. (Over a
real pipeline: tests/distributed/test_micro_batches.py.)"""

from __future__ import annotations

import threading
from types import SimpleNamespace

from offload.distributed.channel import Channel
from offload.distributed.join import Member
from offload.engine.micro_batches import MicroBatches
from offload.llm.cores import micro_batch_count
from offload.planner.stages import Stage


class _Core:
    def __init__(self, running=0, waiting=0, room=100, prefixes=None, preempted=0, usage=0.0):
        self.num_running, self.num_waiting = running, waiting
        self.max_rows, self.max_len = 4, 64
        self.last_error = None
        self.given: list[list] = []
        self.cancelled: list = []
        self.scheduler = SimpleNamespace(
            room=room, prefixes=prefixes, num_preemptions=preempted, kv_usage=usage
        )
        self.stopped = threading.Event()
        self.ran_in: threading.Thread | None = None

    def submit_all(self, requests):
        self.given.append(list(requests))

    def cancel(self, request):
        self.cancelled.append(request)

    def run(self):
        self.ran_in = threading.current_thread()
        self.stopped.wait(timeout=30)

    def close(self, timeout_s=10.0):
        self.stopped.set()

    def warm_up(self):
        pass


def test_requests_go_to_the_least_loaded_core_in_one_submit_each():
    cores = [_Core(running=2, waiting=1), _Core(), _Core(waiting=1)]
    engine = MicroBatches(cores, own_thread=False)
    engine.submit_all(["a", "b", "c", "d"])
    # loads 3, 0, 1: a -> 1; then 3, 1, 1: b -> 1 (the first of the least); 3, 2, 1:
    # c -> 2; 3, 2, 2: d -> 1
    assert [core.given for core in cores] == [[], [["a", "b", "d"]], [["c"]]]
    engine.cancel("b")
    assert all(core.cancelled == ["b"] for core in cores)


def test_counts_errors_and_scheduler_figures_are_the_cores_together():
    first = _Core(running=1, waiting=2, prefixes=SimpleNamespace(queries=10, hits=4))
    second = _Core(running=3, preempted=2, usage=0.5, prefixes=SimpleNamespace(queries=6, hits=2))
    engine = MicroBatches([first, second], own_thread=False)
    assert (engine.num_running, engine.num_waiting, engine.max_rows) == (4, 2, 8)
    assert engine.last_error is None
    second.last_error = ValueError("disk")
    assert engine.last_error is second.last_error
    scheduler = engine.scheduler
    assert (scheduler.room, scheduler.num_preemptions, scheduler.kv_usage) == (200, 2, 0.25)
    assert (scheduler.prefixes.queries, scheduler.prefixes.hits) == (16, 6)
    second.scheduler.room = None  # (a core whose rows hold their whole length)
    assert engine.scheduler.room is None


def test_run_loops_the_first_core_here_and_the_others_in_threads_until_close():
    cores = [_Core(), _Core(), _Core()]
    engine = MicroBatches(cores, own_thread=False)
    runner = threading.Thread(target=engine.run)
    runner.start()
    for core in cores:
        assert _waits_for(lambda core=core: core.ran_in is not None)
    assert cores[0].ran_in is runner
    assert {cores[1].ran_in, cores[2].ran_in}.isdisjoint({runner, threading.current_thread()})
    engine.close()
    runner.join(timeout=10)
    assert not runner.is_alive() and all(core.stopped.is_set() for core in cores)
    assert not any(thread.is_alive() for thread in engine._threads)


def test_own_threads_start_with_the_engine():
    cores = [_Core(), _Core()]
    engine = MicroBatches(cores)
    assert all(_waits_for(lambda core=core: core.ran_in is not None) for core in cores)
    assert len({core.ran_in for core in cores}) == 2
    engine.close()
    assert not any(thread.is_alive() for thread in engine._threads)


def _waits_for(condition, timeout_s: float = 10.0) -> bool:
    done = threading.Event()
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return True
        done.wait(0.01)
    return False


def test_ranks_apart_get_one_micro_batch_each():
    def llm(places, asked=None):
        member = Member(Channel(0, len(places)), Stage(0, len(places), range(1)), [], places)
        pipeline = SimpleNamespace(size=len(places), member=member)
        return SimpleNamespace(_pipeline=pipeline, pipeline_micro_batches=asked)

    assert micro_batch_count(llm(["a cpu", "b cpu", "c cpu"])) == 3
    assert micro_batch_count(llm(["a cuda:0", "a cuda:1"])) == 2
    assert micro_batch_count(llm(["a cpu", "a cpu"])) == 1  # (one host's cores)
    assert micro_batch_count(llm(["a cuda:0", "a cuda:0", "b cpu"])) == 1
    assert micro_batch_count(llm(["a cpu", "a cpu"], asked=4)) == 4
    assert micro_batch_count(SimpleNamespace(_pipeline=None, pipeline_micro_batches=4)) == 1
