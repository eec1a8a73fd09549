"""`LLM(cpu_offload_gb="auto")` with only memory budgets runs the planner's choice: the
fastest placement the engine's memory check passes, with the user's other settings, and
the same tokens as without offloading."""

import pytest
import torch

from offload import LLM, SamplingParams
from offload.cli.options import QUESTION
from offload.config import OffloadConfig
from offload.llm.auto import _merged, planned_configs, wants_plan
from offload.model.build import build_empty

GREEDY = SamplingParams(temperature=0, max_tokens=8)
CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("flags", "wanted"),
    [
        ({"cpu_offload_gb": "auto"}, True),
        ({"cpu_offload_gb": "auto", "cpu_memory_gb": 0.1}, True),
        ({"cpu_offload_gb": "auto", "offload_backend": "uva"}, False),  # backend given
        ({"cpu_offload_gb": 0.1}, False),  # an amount given
        ({"offload_group_size": 2, "offload_num_in_group": 1}, False),  # a layout given
        ({}, False),
    ],
)
def test_only_a_budget_asks_the_planner(flags, wanted):
    assert wants_plan(OffloadConfig.from_dict(flags)) is wanted


def test_the_plan_keeps_the_users_other_settings():
    user = OffloadConfig.from_dict(
        {"cpu_offload_gb": "auto", "disable_pin_memory": True, "cpu_memory_gb": 0.5}
    )
    prefetch = OffloadConfig.from_dict(
        {"offload_group_size": 2, "offload_num_in_group": 1, "cpu_memory_gb": 0.25}
    )
    merged = _merged(user, prefetch)
    assert merged.selected_backend == "prefetch" and merged.disable_pin_memory
    assert merged.prefetch == prefetch.prefetch and merged.uva.cpu_offload_gb == 0
    assert merged.disk.cpu_memory_gb == 0.25 and merged.disk.disk_io == user.disk.disk_io
    uva = _merged(user, OffloadConfig.from_dict({"cpu_offload_gb": 0.13}))
    assert uva.selected_backend == "uva" and uva.uva.cpu_offload_gb == "auto"  # the engine's
    assert not uva.disk.is_active  # UVA of 0.13 GiB meets the host budget: no disk tier


def _answer(llm):
    return llm.chat([{"role": "user", "content": QUESTION}], GREEDY)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def resident_tokens(smollm2_path):
    return _answer(LLM(smollm2_path, max_model_len=256))


@pytest.mark.parametrize(
    "budgets",
    [
        {"device_memory_gb": 0.3},  # half the model off the device: host memory takes it
        {"device_memory_gb": 0.3, "cpu_memory_gb": 0.1},  # and the host only 0.1 GiB: disk
    ],
)
def test_llm_runs_the_planners_first_config_that_fits(smollm2_path, resident_tokens, budgets):
    llm = LLM(smollm2_path, max_model_len=256, cpu_offload_gb="auto", **budgets)
    user = OffloadConfig.from_dict(
        {"cpu_offload_gb": "auto", **{k: v for k, v in budgets.items() if k == "cpu_memory_gb"}}
    )
    ranked = planned_configs(
        smollm2_path,
        build_empty(smollm2_path, "auto"),
        user,
        CPU,
        context_len=256,
        gpu_memory_utilization=0.9,
        device_memory_gb=budgets["device_memory_gb"],
        kv_offload=False,
    )
    chosen = llm.offload_config
    # The planner's configs are ranked; the engine ran the first whose memory it accepts.
    assert chosen.selected_backend == ranked[0].selected_backend
    assert chosen.prefetch == ranked[0].prefetch and chosen.disk == ranked[0].disk
    assert llm.offloader.offloaded_bytes > 0
    if "cpu_memory_gb" in budgets:  # what host memory cannot hold stays on disk
        assert chosen.disk.is_active and llm.offloader.stats().disk.num_units > 0
    assert _answer(llm) == resident_tokens


def test_offload_config_names_the_backend_that_ran(tmp_path):
    """`llm.offload_config` says what runs: "auto" is named as the backend it chose."""
    import zoo

    path = zoo.save_tiny_llm(tmp_path, num_layers=2)
    with LLM(path, cpu_offload_gb=1e-4) as llm:
        assert llm.offload_config.offload_backend == "uva" and llm.offloader.offloaded_bytes
    with LLM(path, offload_group_size=1, offload_num_in_group=1) as llm:
        assert llm.offload_config.offload_backend == "prefetch"
    with LLM(path) as llm:  # nothing offloaded: nothing to name
        assert llm.offload_config.offload_backend == "auto"
