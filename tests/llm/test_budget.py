"""The budget rule at run time (`llm/budget.py`): on a CPU, cpu_memory_gb holds the layer
stack, the KV cache and activations; what cannot hold the minimum is one line with the
numbers and a budget that fits; the server's rows come out of it, not out of free RAM."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import zoo

from offload import SamplingParams
from offload.engine.kv_room import row_pages
from offload.engine.step_runner import StepRunner
from offload.errors import ConfigError, ModelError
from offload.llm import serving
from offload.llm.budget import MARGIN_BYTES, HostBudget
from offload.llm.llm import LLM
from offload.llm.serving import CPU_KV_BYTES, RowPlan, kv_cache_room, plan_rows
from offload.planner.overhead import COMPILER_BYTES, PROCESS_BASELINE_BYTES, fixed_overhead
from offload.sizes import GIB, MIB

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
EVERY_LAYER = {"offload_group_size": 1, "offload_prefetch_step": 2}
MAX_LEN = 256  # positions: the KV cache and activations set aside stay small


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return zoo.save_attentive_llm(tmp_path_factory.mktemp("budget"), num_layers=6)


@pytest.fixture(scope="module")
def expected(checkpoint):
    with LLM(checkpoint, max_model_len=MAX_LEN) as llm:
        return llm.generate(["t3 t4 t5"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _budget(**changes) -> HostBudget:
    fields = dict(
        budget_bytes=GIB, kv_bytes=100 * MIB, kv_given=False, max_model_len=2048,
        activation_bytes=50 * MIB,
    )  # fmt: skip
    return HostBudget(**{**fields, **changes})


def test_the_stack_gets_what_the_kv_cache_and_activations_leave():
    budget = _budget()
    assert budget.stack_bytes == GIB - 150 * MIB - MARGIN_BYTES
    # The KV cache gets all the stack leaves (at least the sequence set aside) ...
    assert budget.kv_room(budget.stack_bytes) == 100 * MIB
    assert budget.kv_room(budget.stack_bytes - 300 * MIB) == 400 * MIB
    # ... or exactly the share given (kv_cache_memory_bytes, swap_space).
    assert _budget(kv_given=True).kv_room(0) == 100 * MIB


def test_a_budget_below_the_minimum_is_one_line_naming_a_budget_that_fits(checkpoint, expected):
    settings = dict(max_model_len=MAX_LEN, enforce_eager=True, **EVERY_LAYER, disk_io="direct")
    with pytest.raises(ModelError) as refused:
        LLM(checkpoint, cpu_memory_gb=0.01, **settings)
    message = str(refused.value)
    assert "\n" not in message
    assert "cpu_memory_gb=0.01 cannot hold the minimum: the layer stack needs at least" in message
    assert f"one sequence of {MAX_LEN} positions" in message
    fits = float(message.split("; cpu_memory_gb=")[1].split()[0])
    with LLM(checkpoint, cpu_memory_gb=fits, **settings) as llm:  # the number said fits
        tokens = llm.generate(["t3 t4 t5"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        stats = llm.offloader.stats()
        budget = llm.host_budget
    assert tokens == expected
    assert stats.disk.ram_bytes <= budget.stack_bytes
    assert stats.host_bytes + stats.device_staging_bytes <= budget.stack_bytes


def test_a_default_context_too_long_for_the_budget_is_shortened_to_fit(checkpoint, caplog):
    """With no max_model_len asked for, the default context shrinks (a power of two) to
    leave the stack its room, said in a log line; one asked for is refused as it was."""
    settings = dict(enforce_eager=True, **EVERY_LAYER, disk_io="direct")
    with LLM(checkpoint, **settings) as whole:
        default_len = whole.max_model_len
    with pytest.raises(ModelError, match="cannot hold the minimum"):
        LLM(checkpoint, cpu_memory_gb=0.01, max_model_len=MAX_LEN, **settings)
    with pytest.raises(ModelError) as refused:
        LLM(checkpoint, cpu_memory_gb=0.01, max_model_len=default_len, **settings)
    fits = float(str(refused.value).split("; cpu_memory_gb=")[1].split()[0])
    with caplog.at_level(logging.WARNING, logger="offload"):
        llm = LLM(checkpoint, cpu_memory_gb=fits - 0.01, **settings)
    with llm:
        assert MAX_LEN <= llm.max_model_len < default_len
        assert llm.max_model_len & (llm.max_model_len - 1) == 0  # a power of two
        assert llm.offloader.stats().disk.ram_bytes <= llm.host_budget.stack_bytes
        assert llm.generate(["t3 t4 t5"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert f"max_model_len {default_len} does not fit cpu_memory_gb=" in caplog.text


def test_layers_a_layout_leaves_resident_come_out_of_the_budget(checkpoint, expected):
    """Every second layer offloaded: the other three stay resident, in RAM beside the rest."""
    layout = dict(offload_group_size=2, offload_num_in_group=1, offload_prefetch_step=2)
    with LLM(checkpoint, max_model_len=MAX_LEN, cpu_memory_gb=0.5, **layout) as llm:
        budget = llm.host_budget
        tokens = llm.generate(["t3 t4 t5"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    layer_bytes = zoo.layer_param_bytes(zoo.build("llama", num_layers=6)) // 6
    assert budget.resident_layer_bytes == 3 * layer_bytes
    others = budget.kv_bytes + budget.activation_bytes + MARGIN_BYTES
    assert budget.stack_bytes == budget.budget_bytes - others - 3 * layer_bytes
    assert tokens == expected


def test_the_servers_rows_come_out_of_the_budget(checkpoint, expected):
    """A budget that holds every layer and 2.5 rows of MAX_LEN positions beside them: the
    server's rows (8) share that room, each request getting its tokens alone."""
    settings = dict(max_model_len=MAX_LEN, disk_io="direct", **EVERY_LAYER)
    with LLM(checkpoint, cpu_memory_gb=1, **settings) as llm:  # all layers kept
        stack_bytes = llm.offloader.stats().disk.ram_bytes
        activation_bytes = llm.host_budget.activation_bytes
        row_bytes = serving.bytes_per_row(llm.model.config, MAX_LEN, torch.float32)
    budget_gb = (MARGIN_BYTES + activation_bytes + stack_bytes + 2.5 * row_bytes) / GIB
    with LLM(checkpoint, cpu_memory_gb=budget_gb, **settings) as llm:
        assert llm.offloader.stats().disk.ram_bytes == stack_bytes
        room, source = kv_cache_room(llm)
        assert source == "of cpu_memory_gb" and 2 * row_bytes <= room < 3 * row_bytes
        served = llm.serving(max_num_seqs=8)
        assert (served.core.max_rows, served.max_model_len) == (8, MAX_LEN)
        assert served.core.scheduler.room == room * MAX_LEN // row_bytes  # (positions)
        outputs = [served.stream(None, [3, 4, 5], GREEDY) for _ in range(3)]
        assert [list(out)[-1].outputs[0].token_ids for out in outputs] == [expected] * 3


def test_generate_runs_within_the_kv_room_preempting_where_rows_outgrow_it(checkpoint, monkeypatch):
    """Five prompts, a KV room of 2.5 rows of MAX_LEN positions: all five start, the rows
    never hold more memory than the room (the scheduler's count of pages, before each
    decode step), the youngest are preempted as they outgrow it, and each sequence gets
    the tokens it gets alone (prompt + 130 > 128: clamped)."""
    params = SamplingParams(temperature=0, max_tokens=130, ignore_eos=True)
    prompts = ["t3 t4 t5", "t6", "t7 t8", "t9 t10 t11 t12", "t13"]
    settings = dict(max_model_len=MAX_LEN, disk_io="direct", **EVERY_LAYER)
    with LLM(checkpoint, cpu_memory_gb=1, **settings) as llm:
        alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
        stack_bytes = llm.offloader.stats().disk.ram_bytes
        activation_bytes = llm.host_budget.activation_bytes
        row_bytes = serving.bytes_per_row(llm.model.config, MAX_LEN, torch.float32)
    budget_gb = (MARGIN_BYTES + activation_bytes + stack_bytes + 2.5 * row_bytes) / GIB
    with LLM(checkpoint, cpu_memory_gb=budget_gb, max_num_seqs=8, **settings) as llm:
        sizes, held, decode = [], [], StepRunner.decode

        def counted(runner, rows):
            sizes.append(len(rows))
            scheduler = llm._generator.core.scheduler
            held.append(sum(row_pages(c, scheduler.page) for c in scheduler.committed))
            return decode(runner, rows)

        monkeypatch.setattr(StepRunner, "decode", counted)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        scheduler = llm._generator.core.scheduler
    assert max(sizes) >= 3 and scheduler.num_preemptions > 0
    assert max(held) <= scheduler.room < 3 * MAX_LEN
    assert [o.outputs[0].token_ids for o in outputs] == [a.token_ids for a in alone]


def test_kv_cache_room_without_a_budget_is_the_share_given_or_todays_cap(monkeypatch):
    cpu = SimpleNamespace(
        host_budget=None,
        kv_cache_memory_bytes=None,
        device=torch.device("cpu"),
        kv_offload=False,
        swap_space_bytes=0,
    )
    monkeypatch.setattr(serving, "available_ram_bytes", lambda: 64 * GIB)
    assert kv_cache_room(cpu) == (CPU_KV_BYTES, "of RAM")  # never more than today's cap
    swapped = SimpleNamespace(**{**vars(cpu), "kv_offload": True, "swap_space_bytes": 7 * MIB})
    assert kv_cache_room(swapped) == (7 * MIB, "of swap_space")  # (rows in host memory)
    given = SimpleNamespace(**{**vars(cpu), "kv_cache_memory_bytes": 3 * MIB})
    assert kv_cache_room(given) == (3 * MIB, "of kv_cache_memory_bytes")
    budget = _budget(kv_given=True, kv_bytes=5 * MIB)
    stack = SimpleNamespace(stats=lambda: SimpleNamespace(disk=SimpleNamespace(ram_bytes=0)))
    budgeted = SimpleNamespace(**{**vars(given), "host_budget": budget, "offloader": stack})
    assert kv_cache_room(budgeted) == (5 * MIB, "of cpu_memory_gb")


def test_rows_shrink_to_the_room_and_one_row_that_does_not_fit_is_refused():
    room = 10 * 4096 * 1000  # ten rows of 4096 positions of 1000 bytes
    assert plan_rows(1000, room, 16, 4096, False) == RowPlan(16, 2560)  # shorter rows first
    assert plan_rows(1000, room, 16, 4096, True) == RowPlan(10, 4096)  # fewer, as long
    with pytest.raises(ConfigError, match="one sequence of 4096 positions"):
        plan_rows(1000, 4095 * 1000, 16, 4096, True)


def test_kv_cache_memory_bytes_is_checked_before_anything_loads():
    with pytest.raises(ConfigError, match=r"kv_cache_memory_bytes must be a number of bytes"):
        LLM("/nonexistent", kv_cache_memory_bytes=0)


def test_the_fixed_overhead_is_the_process_the_parameters_outside_the_stack_and_the_tokenizer(
    checkpoint,
):
    model = zoo.build("llama", num_layers=6)
    outside = sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if not name.startswith("model.layers.")
    )
    overhead = fixed_overhead(model, Path(checkpoint))
    assert overhead.process_bytes == PROCESS_BASELINE_BYTES
    assert overhead.outside_stack_bytes == outside > 0
    assert overhead.tokenizer_bytes == 20 * (Path(checkpoint) / "tokenizer.json").stat().st_size
    assert overhead.total_bytes == PROCESS_BASELINE_BYTES + outside + overhead.tokenizer_bytes
    assert overhead.describe().startswith(f"{overhead.total_bytes / GIB:.2f} GiB (process 0.38")


def test_a_process_whose_cpu_steps_compile_states_the_compiler_beside(checkpoint, monkeypatch):
    model = zoo.build("llama", num_layers=2)
    eager = fixed_overhead(model, Path(checkpoint))
    compiling = fixed_overhead(model, Path(checkpoint), compiles=True)
    assert compiling.compiler_bytes == COMPILER_BYTES > 0
    assert compiling.total_bytes == eager.total_bytes + COMPILER_BYTES
    assert "compiler 0.25" in compiling.describe() and "compiler" not in eager.describe()
    # An LLM on a CPU states it unless its steps stay eager (the suite's switch, enforce_eager).
    monkeypatch.setenv("OFFLOAD_CPU_COMPILE", "1")
    llm = LLM(checkpoint, dtype="float32")
    assert llm.fixed_overhead.compiler_bytes == COMPILER_BYTES
    assert LLM(checkpoint, dtype="float32", enforce_eager=True).fixed_overhead.compiler_bytes == 0
    monkeypatch.setenv("OFFLOAD_CPU_COMPILE", "0")
    assert LLM(checkpoint, dtype="float32").fixed_overhead.compiler_bytes == 0
