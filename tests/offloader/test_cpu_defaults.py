"""CPU defaults: the prefetch unit "auto", a core left to the copy thread during forwards
(and the caller's thread count given back, even after an interrupted forward), and the
OpenMP advice only when spinning is measured to slow the copies."""

from __future__ import annotations

import logging

import pytest
import torch
import zoo

import offload
from offload.memory import copy_engine, threads
from offload.memory.copy_engine import SyncCopyEngine, ThreadCopyEngine
from offload.offloader import units
from offload.offloader.units import AUTO_MODULES_AHEAD, resolve_unit, units_ahead

DEFAULTS = {"offload_group_size": 1, "offload_num_in_group": 1, "offload_prefetch_step": 2}


@pytest.fixture
def small_cache(monkeypatch):
    """A 32 MiB last-level cache, as on the machine where module units were measured."""
    monkeypatch.setattr(units, "last_level_cache_bytes", lambda: 32 * 2**20)


def test_auto_is_layers_on_a_gpu_and_on_a_cpu_modules_where_layers_overflow_the_cache(
    small_cache, monkeypatch
):
    cpu, gpu, mib = torch.device("cpu"), torch.device("cuda", 0), 2**20
    monkeypatch.setattr(units, "available_cores", lambda: torch.get_num_threads())
    assert resolve_unit("auto", cpu, 14 * mib, 2) == "layer"  # no free core: copies inline
    monkeypatch.setattr(units, "available_cores", lambda: torch.get_num_threads() + 1)
    assert resolve_unit("auto", cpu, 14 * mib, 2) == "module"  # 3 x 14 MiB > 32 MiB
    assert resolve_unit("auto", cpu, 10 * mib, 2) == "layer"  # 3 x 10 MiB fit
    assert resolve_unit("auto", cpu, 14 * mib, 1) == "layer"  # 2 x 14 MiB fit
    assert resolve_unit("auto", gpu, 14 * mib, 2) == "layer"
    assert resolve_unit("layer", cpu, 14 * mib, 2) == "layer"
    assert resolve_unit("module", gpu) == "module"


def test_the_last_level_cache_is_read_from_sysfs(tmp_path, monkeypatch):
    for index, size in enumerate(["48K", "2048K", "491520K"]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    monkeypatch.setattr(units, "_CACHE_SIZES", str(tmp_path))
    units.last_level_cache_bytes.cache_clear()
    try:
        assert units.last_level_cache_bytes() == 480 * 2**30 // 1024
    finally:
        units.last_level_cache_bytes.cache_clear()


@pytest.mark.parametrize(
    ("unit", "resolved", "step", "unit_bytes", "layer_bytes", "ahead"),
    [
        ("layer", "layer", 2, [10, 10], 10, 2),  # a chosen unit: the step, in that unit
        ("module", "module", 5, [1, 2, 3], 6, 5),
        ("auto", "layer", 2, [7, 7], 7, 2),
        ("auto", "module", 2, [1, 3, 3], 7, AUTO_MODULES_AHEAD),  # within 2 layers' memory
        ("auto", "module", 1, [1, 3, 3], 7, 2),  # one layer holds only two of the largest
        ("auto", "module", 1, [7], 7, 1),  # a layer of one module: never below one slot
    ],
)
def test_units_ahead_keeps_auto_within_the_memory_of_the_layer_step(
    unit, resolved, step, unit_bytes, layer_bytes, ahead
):
    assert units_ahead(unit, resolved, step, unit_bytes, layer_bytes) == ahead


def test_default_prefetch_on_a_small_cache_cpu_copies_modules_exactly(small_cache, monkeypatch):
    monkeypatch.setattr(units, "last_level_cache_bytes", lambda: 0)  # any layer overflows
    monkeypatch.setattr(units, "available_cores", lambda: torch.get_num_threads() + 1)
    model, reference = zoo.build("llama", num_layers=4), zoo.build("llama", num_layers=4)
    ids = zoo.inputs()
    offloader = offload.apply(model, DEFAULTS, device="cpu")
    stats = offloader.stats()
    assert stats.unit == "module" and stats.num_slots == AUTO_MODULES_AHEAD
    # The staging memory stays within vLLM's meaning of the step: two layers.
    largest_layer = max(
        sum(p.numel() * p.element_size() for p in layer.parameters())
        for layer in reference.model.layers
    )
    assert offloader.device_staging_bytes <= 2 * largest_layer
    assert torch.equal(zoo.logits(model, ids), zoo.logits(reference, ids))
    assert offloader.stats().bytes_copied > stats.bytes_copied


class _Probe:
    """Records torch's thread count inside every forward of the model's first layer."""

    def __init__(self, model, interrupt_once=None):
        self.seen = []
        self.interrupt_once = interrupt_once
        model.model.layers[0].register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.seen.append(torch.get_num_threads())
        if self.interrupt_once is not None:
            error, self.interrupt_once = self.interrupt_once, None
            raise error


@pytest.fixture
def two_threads(monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _offloaded(config=DEFAULTS, copy_engine_factory=None):
    model, reference = zoo.build("llama", num_layers=3), zoo.build("llama", num_layers=3)
    offloader = offload.apply(model, config, device="cpu", copy_engine_factory=copy_engine_factory)
    return model, reference, offloader


@pytest.mark.parametrize("cores", [2, 3])
def test_compute_keeps_the_users_threads_and_the_copies_use_a_free_core_if_any(
    two_threads, monkeypatch, cores
):
    """Fewer compute threads would change float results, so the thread count is never
    touched: with every core computing, copies run on the compute thread; with a core
    free, on a copy thread there."""
    monkeypatch.setattr(copy_engine, "available_cores", lambda: cores)
    model, reference, offloader = _offloaded()
    probe = _Probe(model)
    ids = zoo.inputs()
    assert torch.equal(zoo.logits(model, ids), zoo.logits(reference, ids))
    assert probe.seen == [2] and torch.get_num_threads() == 2
    engine = type(offloader.copy_engine)
    assert engine is (SyncCopyEngine if cores == 2 else ThreadCopyEngine)
    assert offloader.stats().bytes_copied > 0


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_an_interrupted_forward_changes_no_thread_count_and_the_next_is_exact(two_threads, error):
    model, reference, _ = _offloaded()
    probe = _Probe(model, interrupt_once=error)
    ids = zoo.inputs()
    with pytest.raises(type(error)):
        zoo.logits(model, ids)
    assert torch.get_num_threads() == 2
    assert torch.equal(zoo.logits(model, ids), zoo.logits(reference, ids))
    assert probe.seen == [2, 2]


def test_copies_on_the_compute_thread_are_exact_for_both_units(small_cache):
    for unit in ("layer", "module"):
        model, reference, offloader = _offloaded(
            {**DEFAULTS, "prefetch_unit": unit},
            copy_engine_factory=lambda device: SyncCopyEngine(),  # whatever this machine's cores
        )
        ids = zoo.inputs()
        assert torch.equal(zoo.logits(model, ids), zoo.logits(reference, ids))
        assert offloader.copy_engine.stats.bytes_copied > 0


@pytest.mark.parametrize(
    ("idle", "busy", "policy", "compute_threads", "hurts"),
    [
        (20.0, 6.0, "", 4, True),  # copies at 30% of their idle rate while OpenMP spins
        (20.0, 6.0, "active", 4, True),
        (20.0, 6.0, "PASSIVE", 4, False),  # workers sleep: not the spin
        (20.0, 6.0, " passive ", 4, False),
        (20.0, 6.0, "", 1, False),  # one compute thread: no OpenMP workers to spin
        (20.0, 12.0, "", 4, False),  # 60% of idle: compute's own memory traffic, not spin
        (0.0, 6.0, "", 4, False),  # no idle measurement: no claim
    ],
)
def test_spin_hurts_only_when_measured(idle, busy, policy, compute_threads, hurts):
    assert threads.spin_hurts(idle, busy, policy, compute_threads) is hurts


def test_the_advice_is_logged_once_when_copies_slow_down_in_forwards(monkeypatch, caplog):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    engine = ThreadCopyEngine()
    engine._idle, engine._busy = [20_000_000_000, 1.0], [5_000_000_000, 1.0]
    engine._busy_copies = engine._CHECK_AFTER_COPIES
    src, dst = torch.zeros(8, dtype=torch.uint8), torch.ones(8, dtype=torch.uint8)
    with caplog.at_level(logging.WARNING, logger="offload"):
        engine.wait(engine.copy(dst, src))
        engine.wait(engine.copy(dst, src))
    advice = [r for r in caplog.records if "OMP_WAIT_POLICY=PASSIVE" in r.getMessage()]
    assert len(advice) == 1 and "5.0 GB/s during forwards, 20.0 GB/s" in advice[0].getMessage()
    engine.close()


def test_no_advice_for_the_default_prefetch_on_this_machine(caplog):
    model, _, _ = _offloaded()
    with caplog.at_level(logging.WARNING, logger="offload"):
        for _ in range(30):  # 3 layers x 7 modules x 30 forwards: well past the check
            zoo.logits(model, zoo.inputs())
    assert not [r for r in caplog.records if "OMP_WAIT_POLICY" in r.getMessage()]


def test_the_offloader_package_exports_vllms_names():
    import offload.offloader as package

    vllm_names = {
        "BaseOffloader",
        "NoopOffloader",
        "UVAOffloader",
        "PrefetchOffloader",
        "create_offloader",
        "get_offloader",
        "set_offloader",
    }  # vllm.model_executor.offloader.__all__
    assert vllm_names <= set(package.__all__)
    from offload.offloader import PrefetchOffloader

    assert isinstance(package.create_offloader(DEFAULTS), PrefetchOffloader)
    assert offload.PrefetchOffloader is PrefetchOffloader


def test_base_imports_no_backend():
    import ast
    from pathlib import Path

    source = Path(offload.offloader.base.__file__).read_text()
    imported = {
        node.module
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert not imported & {"offload.offloader.prefetch", "offload.offloader.uva"}


def test_the_default_cpu_engine_keeps_llm_outputs_exact_with_the_kv_cache_in_host_memory(
    tmp_path, monkeypatch
):
    """Every core computing: weight and KV copies on the compute thread, logprobs and
    tokens bitwise those of the resident engine."""
    from offload import LLM, SamplingParams

    monkeypatch.setattr(copy_engine, "available_cores", lambda: torch.get_num_threads())
    path = zoo.save_tiny_llm(tmp_path / "tiny", 4)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)

    def run(**flags):
        llm = LLM(path, device="cpu", max_model_len=32, **flags)
        [out] = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params)
        return llm, out.outputs[0]

    _, resident = run()
    llm, offloaded = run(kv_offload=True, **DEFAULTS)
    assert isinstance(llm.offloader.copy_engine, SyncCopyEngine)
    assert offloaded.token_ids == resident.token_ids
    assert offloaded.logprobs == resident.logprobs
    stats = llm.transfer_stats()
    assert stats.weight_copied_bytes > 0 and stats.kv_copied_bytes > 0
