"""What one `LLM(...)` makes once: its offload config is checked once (it is frozen:
nothing checks it again), and its offloader is built once."""

import pytest

from offload.config import OffloadConfig
from offload.llm.llm import LLM
from offload.offloader.base import BaseOffloader


def test_the_offload_config_is_validated_once(smollm2_path, monkeypatch):
    calls = []
    validate = OffloadConfig.validate

    def counted(config):
        calls.append(config)
        validate(config)

    monkeypatch.setattr(OffloadConfig, "validate", counted)
    LLM(smollm2_path)
    assert len(calls) == 1


@pytest.mark.parametrize(
    ("flags", "builds"),
    [
        ({}, 1),  # (no offloading: the no-op offloader)
        ({"cpu_offload_gb": 0.1}, 1),
        ({"offload_group_size": 2, "offload_prefetch_step": 1}, 1),
        ({"cpu_offload_gb": "auto", "offload_backend": "uva", "device_memory_gb": 0.3}, 1),
        # A disk tier's offloader is made again at the load, from the checkpoint's byte
        # ranges as the loader matches them and the process budget (`MemoryPlan.for_load`).
        ({"cpu_memory_gb": 0.1}, 2),
    ],
    ids=["none", "uva", "prefetch", "uva-auto", "disk-tier"],
)
def test_the_offloader_is_built_once(smollm2_path, monkeypatch, flags, builds):
    """The fit check plans with the offloader the config selects (a dry run, on the model
    built on the meta device); the load wraps that model with that same offloader. (Where
    the planner ranks configs, `cpu_offload_gb="auto"` with budgets only, each one the fit
    check tries is planned with its own: those that do not fit are dropped unwrapped.)"""
    built = []
    make = BaseOffloader.__init__

    def counted(offloader, *args, **kwargs):
        built.append(type(offloader).__name__)
        make(offloader, *args, **kwargs)

    monkeypatch.setattr(BaseOffloader, "__init__", counted)
    llm = LLM(smollm2_path, dtype="float32", max_model_len=256, **flags)
    assert built == [type(llm.offloader).__name__] * builds
    if flags.get("cpu_offload_gb") == "auto":
        assert llm.offloader.offloaded_bytes > 0  # ("auto" resolved to an amount that fits)
