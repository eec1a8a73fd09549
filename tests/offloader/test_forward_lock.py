"""An offloaded model called from several threads, and after an abandoned forward."""

import gc
import threading
import time
import weakref

import pytest
import torch
import zoo
from engines import SlowEngine
from interrupts import run_in_threads

import offload
from offload.api import finish, prepare
from offload.offloader.base import NoopOffloader

PREFETCH = {"offload_group_size": 1, "offload_prefetch_step": 2}


def _offloaded(num_layers=12, config=PREFETCH, engine=None):
    model = zoo.build("llama", num_layers=num_layers)
    reference = zoo.build("llama", num_layers=num_layers)
    factory = (lambda device: engine) if engine is not None else None
    offloader = prepare(model, config, torch.device("cpu"), copy_engine_factory=factory)
    return model, finish(offloader), reference


def _copy_threads():
    return [t for t in threading.enumerate() if t.name.startswith("offload-copy") and t.is_alive()]


@pytest.mark.parametrize("unit", ["layer", "module"])
def test_forwards_from_four_threads_equal_the_resident_outputs(unit):
    model, offloader, reference = _offloaded(
        config={**PREFETCH, "prefetch_unit": unit}, engine=SlowEngine(delay_s=0.0005)
    )
    inputs = [zoo.inputs(seed) for seed in range(8)]
    with torch.no_grad():
        expected = [reference(input_ids=ids).logits for ids in inputs]
    wrong, errors = [], []

    def work(thread, stop):
        try:
            for call in range(20):
                if stop.is_set():
                    return
                index = (thread + call) % len(inputs)
                with torch.no_grad():
                    out = model(input_ids=inputs[index]).logits
                if not torch.equal(out, expected[index]):
                    wrong.append((thread, call))
        except BaseException as error:
            errors.append(error)

    run_in_threads(work, 4)
    assert not errors and not wrong, (errors, f"{len(wrong)} of 80 forwards were wrong")
    assert offloader.stats().bytes_copied > 0


class _InterruptOnce:
    """A forward hook that raises KeyboardInterrupt in the forward it is armed for."""

    def __init__(self):
        self.armed = False

    def __call__(self, module, args, output):
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt


@pytest.mark.parametrize("unit", ["layer", "module"])
def test_an_interrupted_forward_leaves_the_model_exact_for_this_and_other_threads(unit):
    model, _, reference = _offloaded(config={**PREFETCH, "prefetch_unit": unit})
    interrupt = _InterruptOnce()
    model.model.layers[5].mlp.register_forward_hook(interrupt)
    ids = zoo.inputs()
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        interrupt.armed = True
        with pytest.raises(KeyboardInterrupt):
            model(input_ids=ids)
        # Another thread is not locked out by the abandoned forward, and is exact.
        other = {}
        thread = threading.Thread(
            target=lambda: other.update(out=model(input_ids=ids).logits), daemon=True
        )
        thread.start()
        try:
            thread.join(timeout=30)
        finally:  # (a Ctrl-C in the join: the thread ends before the interpreter does)
            thread.join(timeout=30)
        assert not thread.is_alive(), "the abandoned forward's lock was never given back"
        assert torch.equal(other["out"], expected)
        interrupt.armed = True
        with pytest.raises(KeyboardInterrupt):
            model(input_ids=ids)
        assert torch.equal(model(input_ids=ids).logits, expected)  # this thread too
    assert torch._C._len_torch_function_stack() == 0  # no read check left behind


def test_a_thread_waits_for_a_forward_in_progress():
    model, _, _ = _offloaded()
    held = threading.Event()
    release = threading.Event()

    def slow_layer(module, args):
        held.set()
        release.wait(10)

    handle = model.model.layers[3].register_forward_pre_hook(slow_layer)
    first = threading.Thread(target=lambda: zoo.logits(model, zoo.inputs()), daemon=True)
    first.start()
    held.wait(10)
    handle.remove()
    finished = []
    second = threading.Thread(
        target=lambda: finished.append(zoo.logits(model, zoo.inputs())), daemon=True
    )
    second.start()
    try:
        time.sleep(0.3)
        assert not finished, "a second forward ran while the first was inside the model"
    finally:  # (however the test ends, its threads end before the interpreter does)
        release.set()
        first.join(10)
        second.join(10)
    assert finished


def test_an_unreferenced_model_frees_its_offloader_and_copy_thread(monkeypatch):
    from offload.memory import copy_engine

    # A free core: the copies run on a copy thread (else on the compute thread, no thread).
    monkeypatch.setattr(copy_engine, "available_cores", lambda: torch.get_num_threads() + 1)
    gc.collect()
    before = set(_copy_threads())
    model, offloader, _ = _offloaded()
    zoo.logits(model, zoo.inputs())
    assert offload.get_offloader() is offloader and set(_copy_threads()) - before
    gone = weakref.ref(offloader)
    del model, offloader
    gc.collect()
    assert gone() is None, "something still holds the offloader"
    assert isinstance(offload.get_offloader(), NoopOffloader)
    deadline = time.monotonic() + 5
    while set(_copy_threads()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not set(_copy_threads()) - before


class _GatedEngine(SlowEngine):
    """Holds the first compute-side wait until `gate` opens."""

    def __init__(self):
        super().__init__(delay_s=0.0)
        self.waiting, self.gate = threading.Event(), threading.Event()

    def wait(self, ticket):
        if not self.gate.is_set():
            self.waiting.set()
            self.gate.wait(10)
        super().wait(ticket)


def test_a_compiled_model_called_from_two_threads_at_once_is_refused_never_wrong():
    torch._dynamo.reset()
    engine = _GatedEngine()
    model, offloader, reference = _offloaded(4, {**PREFETCH, "prefetch_unit": "layer"}, engine)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    ids = zoo.inputs()
    expected = zoo.logits(reference, ids)
    engine.gate.set()
    assert torch.equal(zoo.logits(compiled, ids), expected)  # compiles, alone: exact
    engine.gate.clear()
    first = {}
    thread = threading.Thread(
        target=lambda: first.update(out=zoo.logits(compiled, ids)), daemon=True
    )
    thread.start()
    try:
        assert engine.waiting.wait(10)  # the first call is inside a layer's wait
        with pytest.raises(offload.ModelError, match="two threads at once"):
            zoo.logits(compiled, ids)
    finally:  # (however the test ends, its thread ends before the interpreter does)
        engine.gate.set()
        thread.join(10)
    assert torch.equal(first["out"], expected)
    assert torch.equal(zoo.logits(compiled, ids), expected)  # and alone again: exact
    assert offloader.stats().bytes_copied > 0
    torch._dynamo.reset()
