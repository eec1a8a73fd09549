"""An exception at every step of the offload protocol, then the clean run's exact output.

A trace function follows the bytecode of the protocol's functions (slot table, prefetch
offloader, copy engine, hooks, read checks, the forward lock, the KV offloader) and
raises a KeyboardInterrupt at one chosen instruction; the next call must give the same
bits as a model that was never interrupted. Each run picks another instruction, so a
Ctrl-C at any step of load, refill, wait and release is covered, not only at random
times.

The instructions are those where CPython can raise an asynchronous exception such as
Ctrl-C's: the start of a function, right after a call returns (or while it blocks), and
the top of a loop (where the interpreter checks for signals). Not, say, between
`with lock:`'s exit call being loaded and made, where no signal can land and a raise
would leak any lock. A trace function sees only the thread that sets it: the copy
thread's own work is never interrupted, as with a real Ctrl-C, which Python delivers to
the main thread.
"""

from __future__ import annotations

import copy
import dis
import sys

import pytest
import torch
import zoo
from engines import SlowEngine

from offload import SamplingParams
from offload.api import finish, prepare
from offload.engine import kv_cache
from offload.llm.llm import LLM
from offload.memory import copy_engine, slots
from offload.offloader import (
    compiled_calls,
    forward_lock,
    hooks,
    module_units,
    prefetch,
    sources,
    unit_check,
    units,
)


class Injected(KeyboardInterrupt):
    """What the trace function raises: a Ctrl-C, so `except Exception` lets it through."""


def _code_objects(*owners) -> set:
    codes = set()
    for owner in owners:
        for value in vars(owner).values():
            function = getattr(value, "__func__", getattr(value, "fget", value))
            if hasattr(function, "__code__"):
                codes.add(function.__code__)
    return codes


PROTOCOL = _code_objects(
    prefetch.PrefetchOffloader,
    slots.SlotTable,
    copy_engine.ThreadCopyEngine,
    hooks.PrefetchHook,
    hooks.CopyOnForwardHook,
    unit_check.UnitReadCheck,
    module_units.ModuleUnits,
    module_units.LayerUnits,
    sources.SlabSource,
    compiled_calls.CompiledCalls,
    units.Unit,
    forward_lock.ForwardLock,
    forward_lock.ForwardLockHooks,
    kv_cache.KVOffloader,
    kv_cache.KVHostPool,
) - {prefetch.PrefetchOffloader.stats.__code__}


_SIGNAL_AFTER = {dis.opmap[name] for name in ("CALL", "CALL_FUNCTION_EX", "JUMP_BACKWARD")}
_RESUME = dis.opmap["RESUME"]


class Tracer:
    """Lists the protocol's interruptible instructions as they run, or raises `Injected`
    at the `at` = (instruction, k)-th time that instruction runs."""

    def __init__(self, at: tuple[tuple[object, int], int] | None = None):
        self.at = at
        self.sites: list[tuple[object, int]] = []  # (code, instruction offset) in order
        self.fired = False
        self._runs: dict[tuple[object, int], int] = {}
        self._previous: dict[int, int] = {}  # frame id -> the opcode it ran last

    def __enter__(self) -> Tracer:
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc_info) -> None:
        sys.settrace(None)

    def _call(self, frame, event, arg):
        if frame.f_code not in PROTOCOL:
            return None
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return self._step

    def _step(self, frame, event, arg):
        if event != "opcode":
            return self._step
        opcode = frame.f_code.co_code[frame.f_lasti]
        previous = self._previous.get(id(frame))
        self._previous[id(frame)] = opcode
        if opcode != _RESUME and previous not in _SIGNAL_AFTER:
            return self._step
        site = (frame.f_code, frame.f_lasti)
        self._runs[site] = self._runs.get(site, 0) + 1
        if self.at == (site, self._runs[site]):
            self.fired = True
            raise Injected
        self.sites.append(site)
        return self._step


def _injection_points(sites: list, every: bool) -> list[tuple[tuple[object, int], int]]:
    """(instruction, k): every run of every instruction, or (to bound the time) the
    first and the last run of each. Counted per instruction, so that a copy that
    happens to be done already (a shorter path through a wait) shifts nothing else."""
    runs: dict[tuple[object, int], int] = {}
    for site in sites:
        runs[site] = runs.get(site, 0) + 1
    if every:
        return [(site, k) for site, count in runs.items() for k in range(1, count + 1)]
    return sorted({(site, k) for site, count in runs.items() for k in (1, count)}, key=str)


def _sweep(make, every: bool) -> int:
    """`make()` gives a workload and a check of a clean run. Run the workload once to
    learn the protocol's instructions, then once per injection point with an interrupt
    there, each time followed by the check. Each injection gets a new `make()`, so that
    the instructions are those of the first run (a module-unit read check runs only in
    a layer's first calls)."""
    workload, _ = make()
    with Tracer() as tracer:
        workload()
    points = _injection_points(tracer.sites, every)
    interrupted = 0
    for at in points:
        workload, check = make()
        try:
            with Tracer(at) as injector:
                workload()
        except Injected:
            pass
        interrupted += injector.fired
        check(at[0])
    assert interrupted >= len(points) * 0.9, "injection points were never reached"
    return interrupted


def forwards_and_check(model, offloader, ids, expected, moved: list, counter):
    """A workload of two forwards, and the check after an interrupt: the next forward
    gives `expected` bit for bit, and `counter(offloader.stats())`, bytes moved, is noted."""

    def two_forwards():
        zoo.logits(model, ids)
        zoo.logits(model, ids[:, :5])

    def check(site):
        out = zoo.logits(model, ids)
        where = f"{site[0].co_qualname}+{site[1]}"
        assert torch.equal(out, expected), f"wrong after an interrupt at {where}"
        moved.append(counter(offloader.stats()))

    return two_forwards, check


@pytest.mark.parametrize(
    ("unit", "every", "fresh"),
    [
        ("layer", True, False),  # every instruction of two forwards, one model throughout
        ("layer", False, True),  # each instruction's first and last run, in a new model
        ("module", False, True),
    ],
)
def test_an_interrupt_at_any_step_of_a_forward_leaves_the_next_forward_exact(unit, every, fresh):
    config = {"offload_group_size": 1, "offload_prefetch_step": 2, "prefetch_unit": unit}
    ids = zoo.inputs()
    base = zoo.build("llama", num_layers=5)
    expected = zoo.logits(base, ids)
    moved = []

    def make():
        model = copy.deepcopy(base)
        offloader = prepare(
            model,
            config,
            torch.device("cpu"),
            copy_engine_factory=lambda device: SlowEngine(delay_s=0.0002),
        )
        finish(offloader)
        return forwards_and_check(
            model, offloader, ids, expected, moved, lambda stats: stats.bytes_copied
        )

    shared = make()
    assert _sweep(make if fresh else lambda: shared, every) > 50
    assert min(moved) > 0


def test_an_interrupt_at_any_step_of_generate_leaves_the_next_generate_exact(tmp_path):
    llm = LLM(
        zoo.save_tiny_llm(tmp_path, num_layers=4),
        offload_group_size=1,
        offload_prefetch_step=2,
        kv_offload=True,
    )
    prompts = ["t5 t9 t11", "t7"]
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)

    def run():
        return [
            (o.outputs[0].token_ids, o.outputs[0].logprobs)
            for o in llm.generate(prompts, greedy, use_tqdm=False)
        ]

    expected = run()

    def check(site):
        assert run() == expected, f"wrong after an interrupt at {site[0].co_qualname}+{site[1]}"

    # One LLM throughout: its state after each interrupted call is what the next one meets.
    assert _sweep(lambda: (run, check), every=False) > 100
    assert llm.transfer_stats().kv_copied_bytes > 0
