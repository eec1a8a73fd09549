"""A CPU's one memory budget (planner/budget.py): on a CPU given `cpu_memory_gb` the
planner offers only what fits it (layers in RAM, slots, KV cache, activations), measures
only the batches it can hold, says what bound the choice, and its flags carry it."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.cli.main import build_parser
from offload.config import OffloadConfig
from offload.errors import ModelError
from offload.memory.placement import DiskIO
from offload.planner import layouts
from offload.planner.budget import least_ram, overhead_without_tokenizer, ram_use
from offload.planner.choose import candidates
from offload.planner.fit import MARGIN_BYTES
from offload.planner.flags import kv_flags, offload_flags, vllm_flags, warnings_for
from offload.planner.plan import budgets_for, measurable_batches
from offload.sizes import GIB, MIB

CPU = torch.device("cpu")
BATCHES = [1, 2, 4, 8, 16, 32, 64]


def on_cpu(cpu_memory_gb: float):
    """The budgets `offload plan --device cpu --cpu-memory-gb ...` plans with."""
    return budgets_for(CPU, 0.9, None, cpu_memory_gb)


def test_a_budget_below_the_stack_offers_no_resident_and_no_batch_beyond_it(
    recorded, smollm2_shape
):
    # SmolLM2 in float32: 405 MiB of layers, 45 MiB of KV cache a sequence at 1024
    # positions; with every layer read from disk batch 2 needs 226 MiB, batch 4 316 MiB.
    budgets = on_cpu(0.25)
    assert budgets.ram_bytes == 256 * MIB
    found = candidates(smollm2_shape, recorded["cpu-smollm2"], budgets, BATCHES)
    assert found and {c.batch_size for c in found} == {1, 2}
    for candidate in found:
        assert candidate.layout.offloaded_bytes > 0  # never every layer resident
        assert candidate.ram.total_bytes <= budgets.ram_bytes
        assert candidate.ram.kv_bytes == smollm2_shape.kv_bytes(candidate.batch_size, 1024)
    assert least_ram(smollm2_shape, 4, 1024).total_bytes > budgets.ram_bytes


def test_the_plan_says_what_bound_it_and_its_flags_carry_the_budget(
    recorded, smollm2_shape, planned
):
    plan = planned(smollm2_shape, recorded["cpu-smollm2"], on_cpu(0.25))
    reasons = "\n".join(plan.reasons)
    assert "budget: 256.0 MiB of RAM (cpu_memory_gb) for the layers' weights held" in reasons
    assert "beside it the fixed overhead, " in reasons and "peak RSS within " in reasons
    assert "bound by the RAM budget: every layer resident needs 5" in reasons
    assert f"batch {plan.batch_size}: batch {2 * plan.batch_size} does not fit" in reasons
    assert warnings_for(plan) != ["the model fits: no offloading needed"]
    flags = offload_flags(plan)
    assert flags[flags.index("--cpu-memory-gb") + 1] == "0.25"
    assert flags[flags.index("--disk-io") + 1] == "direct"  # (never mapped beyond the budget)
    # Two sequences' KV cache, as the run is told it (else it sets aside one sequence's).
    kv = str(2 * smollm2_shape.kv_bytes(1, 1024))
    assert plan.batch_size == 2 and kv_flags(plan) == ["--kv-cache-memory-bytes", kv]
    assert vllm_flags(plan)[0][-2:] == ["--kv-cache-memory-bytes", kv]
    # The flags, as `offload generate` parses them, are the config the plan counted.
    args = build_parser().parse_args(["generate", *flags])
    assert OffloadConfig.from_cli_args(args) == plan.config
    assert args.max_model_len == 1024


def test_resident_only_at_the_batches_whose_kv_cache_the_budget_holds(recorded, smollm2_shape):
    # 405 MiB of layers + 45 MiB a sequence + activations + slack: at most 12 sequences.
    budgets = on_cpu(1)
    found = candidates(smollm2_shape, recorded["cpu-smollm2"], budgets, BATCHES)
    resident = [c for c in found if not c.layout.offloaded_bytes]
    assert {c.batch_size for c in resident} == {1, 2, 4, 8}
    # Batch 16 fits only with layers read from disk (16 x 45 MiB of KV cache), 32 not at all.
    assert max(c.batch_size for c in found) == 16
    assert all(c.ram.total_bytes <= budgets.ram_bytes for c in found)


def test_only_the_batches_the_budget_holds_are_measured(smollm2_shape):
    assert measurable_batches(smollm2_shape, on_cpu(0.25), BATCHES, 1024) == [1, 2]
    assert measurable_batches(smollm2_shape, on_cpu(1), BATCHES, 1024) == [1, 2, 4, 8, 16]
    with pytest.raises(ModelError) as error:
        measurable_batches(smollm2_shape, on_cpu(0.1), [1, 2], 1024)
    message = str(error.value)
    assert message.startswith("cpu_memory_gb=0.1 GiB cannot hold one sequence of 1024 ")
    assert "--cpu-memory-gb 0.18 fits" in message and "\n" not in message


def test_an_emulated_device_keeps_the_budgets_apart():
    budgets = budgets_for(CPU, 0.9, 0.4, 0.1)  # --device-memory-gb: a GPU played on a CPU
    assert budgets.ram_bytes is None
    assert (budgets.device_bytes, budgets.host_bytes) == (int(0.4 * GIB * 0.9), int(0.1 * GIB))


def test_a_plan_from_numbers_states_the_models_overhead(smollm2_path, smollm2_shape):
    """The shape's overhead is the built model's (`overhead.fixed_overhead`) less the
    tokenizer, which only a model's files say."""
    from offload.model.build import build_empty
    from offload.planner.overhead import fixed_overhead

    model = build_empty(smollm2_path, "float32")
    assert overhead_without_tokenizer(smollm2_shape) == fixed_overhead(model)


@settings(max_examples=20, deadline=None)
@given(room_mib=st.integers(0, 600))
def test_a_layout_within_the_budget_keeps_only_what_the_room_holds(smollm2_shape, room_mib):
    """Each layout keeps offloaded layers in RAM only as far as the room left beside its
    resident layers and slots; where not even those fit, it keeps none (and the fit check
    refuses it)."""
    room = room_mib * MIB
    found = layouts.prefetch_layouts_within(smollm2_shape, room, DiskIO.DIRECT, 0.5)
    assert found
    for layout in found:
        use = ram_use(smollm2_shape, layout, 0)
        assert use.layer_bytes + use.staging_bytes <= room or layout.host_bytes == 0
        assert layout.config.disk.cpu_memory_gb == 0.5  # the budget, as the run takes it


def test_more_room_keeps_more_layers(smollm2_shape):
    kept = [
        layouts.prefetch_within(smollm2_shape, 1, 1, 1, room * MIB, DiskIO.DIRECT, 1).host_bytes
        for room in range(0, 500, 25)
    ]
    assert kept == sorted(kept) and kept[0] == 0 and kept[-1] == sum(smollm2_shape.layer_bytes)


def test_the_margin_is_counted_once(smollm2_shape):
    use = least_ram(smollm2_shape, 1, 1024)
    assert use.margin_bytes == MARGIN_BYTES
    assert use.total_bytes == (
        use.layer_bytes + use.staging_bytes + use.kv_bytes + use.activation_bytes + MARGIN_BYTES
    )


def test_the_least_is_never_more_than_every_layer_resident(shape_from):
    """Two layers: the disk tier's slots are never more than the layers (two, not the
    three it reads ahead with), so the least a budget must hold is at most the stack."""
    import transformers as tf

    config = tf.LlamaConfig(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=8, vocab_size=1000, max_position_embeddings=1024,
    )  # fmt: skip
    shape = shape_from(config, torch.float32)
    least = least_ram(shape, 1, 1024)
    assert least.staging_bytes <= sum(shape.layer_bytes)
    budgets = on_cpu(least.total_bytes / GIB + 0.001)
    assert measurable_batches(shape, budgets, [1, 2], 1024) == [1]
