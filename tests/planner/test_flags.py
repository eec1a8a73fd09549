"""A plan's flags parse back, with the real parsers, to the plan's own config."""

import pytest

from offload.cli import build_parser
from offload.config import OffloadConfig
from offload.config.flags import parse_flags
from offload.planner.choose import Budgets, candidates
from offload.planner.flags import (
    VLLM_DESTS,
    as_flags,
    config_values,
    offload_flags,
    vllm_flags,
    warnings_for,
)
from offload.sizes import GIB, MIB

HOST = 128 * GIB


@pytest.fixture(scope="module")
def plans(recorded, llama8b_shape, smollm2_shape, moe_shape, planned):
    """A plan of each kind, from the recorded measurement sets."""
    gpu, cpu = recorded["h100-llama-3-8b"], recorded["cpu-smollm2"]
    return {
        "resident": planned(llama8b_shape, gpu, Budgets(70 * GIB, HOST)),
        "prefetch": planned(llama8b_shape, gpu, Budgets(10 * GIB, HOST), [1]),
        "disk tier": planned(smollm2_shape, cpu, Budgets(360 * MIB, 100 * MIB)),
        "uva experts": planned(moe_shape, gpu, Budgets(moe_shape.weight_bytes // 2, HOST), [1]),
        "kv cache in host memory": planned(llama8b_shape, gpu, Budgets(12 * GIB, HOST), [64]),
    }


def test_the_plans_are_of_each_kind(plans):
    assert plans["resident"].config == OffloadConfig()
    assert plans["prefetch"].config.offload_backend == "prefetch"
    assert plans["disk tier"].config.disk.is_active
    assert plans["uva experts"].config.uva.cpu_offload_params == {"experts"}
    assert plans["kv cache in host memory"].kv_offload


@pytest.mark.parametrize(
    "kind", ["resident", "prefetch", "disk tier", "uva experts", "kv cache in host memory"]
)
def test_offload_flags_parse_back_to_the_plan(plans, kind):
    plan = plans[kind]
    args = build_parser().parse_args(["generate", *offload_flags(plan)])
    assert OffloadConfig.from_cli_args(args) == plan.config
    assert args.kv_offload == plan.kv_offload
    assert args.max_model_len == plan.context_len


@pytest.mark.parametrize("kind", ["resident", "prefetch", "uva experts", "disk tier"])
def test_vllm_flags_say_what_vllm_can_express(plans, kind):
    plan = plans[kind]
    flags, missing = vllm_flags(plan)
    assert flags[-4:] == ["--max-num-seqs", str(plan.batch_size), "--max-model-len", "1024"]
    expressed = OffloadConfig.from_cli(flags[:-4])
    if not missing:
        assert expressed == plan.config
    else:
        assert kind == "disk tier" and "--cpu-memory-gb (ours)" in missing
        assert set(missing) <= {"--cpu-memory-gb (ours)", "--disk-io (ours)"}
        assert expressed.prefetch == plan.config.prefetch
    assert set(config_values(expressed)) <= set(VLLM_DESTS)


def test_kv_offload_is_named_where_vllm_has_no_flag(plans):
    _, missing = vllm_flags(plans["kv cache in host memory"])
    assert "the KV cache in host memory (--kv-offload)" in missing


def test_flag_values_are_written_to_parse_exactly():
    config = OffloadConfig(
        offload_backend="uva",
        uva={"cpu_offload_gb": 8.29, "cpu_offload_params": {"experts", "w2"}},
        disable_uva=True,
    )
    flags = as_flags(config_values(config))
    assert flags == [
        "--offload-backend",
        "uva",
        "--cpu-offload-gb",
        "8.29",
        "--cpu-offload-params",
        "experts",
        "w2",
        "--offload-disable-uva",
    ]
    assert OffloadConfig.from_cli_args(parse_flags(flags)) == config


def test_warnings(plans, recorded, llama8b_shape):
    assert warnings_for(plans["resident"]) == ["the model fits: no offloading needed"]
    plan = plans["prefetch"]
    (warning,) = warnings_for(plan)
    assert warning.startswith("transfer-bound: step is ") and "x compute; batch " in warning
    # The batch it names runs a step at most 10% longer than the chosen one.
    larger = int(warning.split("; batch ")[1].split()[0])
    assert larger > plan.batch_size
    best = candidates(llama8b_shape, recorded["h100-llama-3-8b"], plan.budgets, [larger])[0]
    assert best.time.step_s <= 1.1 * plan.chosen.time.step_s
