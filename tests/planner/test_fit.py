"""Does it fit? Checked before loading, with the numbers and the smallest fix."""

import re

import pytest
import torch
from transformers import AutoConfig

import offload
from offload import ConfigError, ModelError, SamplingParams
from offload.cli import main
from offload.llm.llm import LLM
from offload.planner.fit import MemoryNeeds, kv_cache_bytes, smallest_offload_gb

GREEDY = SamplingParams(temperature=0, max_tokens=10)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GIB = 1024**3


def test_kv_cache_bytes(smollm2_path):
    config = AutoConfig.from_pretrained(smollm2_path)
    # 2 (K and V) x 30 layers x 3 KV heads x 64 dims x 512 tokens x 4 bytes
    assert kv_cache_bytes(config, 512, torch.float32) == 2 * 30 * 3 * 64 * 512 * 4
    assert kv_cache_bytes(config, 512, torch.bfloat16, batch=2) == 2 * 30 * 3 * 64 * 512 * 2 * 2


def test_smallest_offload():
    needs = MemoryNeeds(
        weights=GIB, layer_stack=GIB // 2, largest_layer=GIB // 64, kv_cache=0, activations=0
    )
    assert smallest_offload_gb(needs, 2 * GIB) == 0.0
    assert smallest_offload_gb(needs, GIB // 4) is None  # more than the whole stack
    assert smallest_offload_gb(needs, int(0.8 * GIB)) == pytest.approx(
        0.27
    )  # 0.2 GiB + 64 MiB margin, rounded up


@pytest.fixture(scope="module")
def resident_answer(smollm2_path):
    return LLM(smollm2_path).chat(QUESTION, GREEDY)[0].outputs[0].token_ids


def test_too_big_fails_before_loading_with_the_fix(smollm2_path):
    with pytest.raises(ModelError) as info:
        LLM(smollm2_path, device_memory_gb=0.45, max_model_len=512)
    message = str(info.value)
    assert "\n" not in message and "does not fit" in message and "budget is 0.40 GiB" in message
    assert re.search(r"--cpu-offload-gb \d+\.\d\d", message)


def test_the_suggested_amount_fits_and_is_exact(smollm2_path, resident_answer):
    with pytest.raises(ModelError) as info:
        LLM(smollm2_path, device_memory_gb=0.45, max_model_len=512)
    suggested = float(re.search(r"--cpu-offload-gb (\d+\.\d\d)", str(info.value)).group(1))
    llm = LLM(smollm2_path, device_memory_gb=0.45, max_model_len=512, cpu_offload_gb=suggested)
    assert llm.chat(QUESTION, GREEDY)[0].outputs[0].token_ids == resident_answer
    with pytest.raises(ModelError, match="does not fit"):
        LLM(smollm2_path, device_memory_gb=0.45, max_model_len=512, cpu_offload_gb=suggested - 0.05)


def test_auto_picks_the_smallest_amount_that_fits(smollm2_path, resident_answer):
    llm = LLM(smollm2_path, device_memory_gb=0.45, max_model_len=512, cpu_offload_gb="auto")
    needs = llm.memory_needs
    excess = needs.total - int(0.45 * GIB * 0.9)
    assert excess <= llm.offloader.offloaded_bytes <= excess + 0.02 * GIB + needs.largest_layer
    assert llm.chat(QUESTION, GREEDY)[0].outputs[0].token_ids == resident_answer
    fits = LLM(
        smollm2_path, cpu_offload_gb="auto", max_model_len=512
    )  # the whole host: nothing to offload
    assert fits.offloader.offloaded_bytes == 0


def test_prefetch_staging_counts_against_the_budget(smollm2_path):
    LLM(
        smollm2_path,
        device_memory_gb=0.3,
        max_model_len=512,
        offload_group_size=1,
        offload_prefetch_step=2,
    )
    with pytest.raises(ModelError, match="does not fit"):
        LLM(
            smollm2_path,
            device_memory_gb=0.3,
            max_model_len=512,
            offload_group_size=4,
            offload_num_in_group=1,
        )


def test_nothing_fits_says_so(smollm2_path):
    with pytest.raises(ModelError, match="does not fit even with every layer offloaded"):
        LLM(smollm2_path, device_memory_gb=0.05, cpu_offload_gb="auto")


def test_auto_needs_an_engine():
    with pytest.raises(ConfigError, match="cpu_offload_gb='auto' needs"):
        offload.create_offloader({"cpu_offload_gb": "auto"})


def test_cli_auto(capsys, smollm2_path):
    argv = [
        "generate",
        "--cpu-offload-gb",
        "auto",
        "--device-memory-gb",
        "0.45",
        "--max-model-len",
        "512",
        "--dtype",
        "float32",  # (as stored, the default model fits 0.45 GiB whole)
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "The capital of France is Paris." and "UVAOffloader" in out[-1]


def test_kv_offload_lets_a_longer_context_fit(smollm2_path, resident_answer):
    """At 4096 positions the KV cache (189 MB) does not fit the emulated device beside
    the rest; in host memory, with two layers' worth of device slots, it does."""
    budget = {"device_memory_gb": 0.45, "max_model_len": 4096, "cpu_offload_gb": 0.4}
    with pytest.raises(ModelError, match=r"KV cache 0\.18, .*kv_offload=True"):
        LLM(smollm2_path, **budget)
    llm = LLM(smollm2_path, kv_offload=True, **budget)
    assert (
        llm.memory_needs.kv_cache == 2 * kv_cache_bytes(llm.model.config, 4096, torch.float32) // 30
    )
    assert llm.chat(QUESTION, GREEDY)[0].outputs[0].token_ids == resident_answer


def test_a_model_larger_than_this_machines_ram_is_told_the_disk_tier(capsys):
    """On a CPU the device is the host's RAM: moving weights to "host memory" frees
    nothing, so a model larger than RAM is told the disk tier, not --cpu-offload-gb."""
    assert main(["inspect", "llama-3-70b", "--device", "cpu", "--max-model-len", "512"]) == 0
    out = capsys.readouterr().out
    assert "does not fit this machine's RAM" in out and "--cpu-offload-gb" not in out
    assert re.search(r"the disk tier keeps \d+\.\d\d GiB of layers in RAM.*--cpu-memory-gb", out)
    assert "add e.g. --cpu-memory-gb 4" in out


def test_offloading_more_than_the_host_holds_is_told_the_disk_tier(smollm2_path, monkeypatch):
    """A device budget (emulated here) whose fix would move more to RAM than is available:
    the disk tier is the fix said, with the RAM it may keep."""
    from offload.llm import fit

    monkeypatch.setattr(fit, "available_ram_bytes", lambda: 100 * 2**20)
    with pytest.raises(ModelError) as info:
        LLM(smollm2_path, dtype="float32", device_memory_gb=0.3, max_model_len=512)
    message = str(info.value)
    assert "more than the 0.10 GiB of RAM available" in message and "\n" not in message
    assert "--cpu-memory-gb 0.07 --offload-group-size 1 --offload-prefetch-step 2" in message


def test_an_unknown_shape_name_lists_the_shipped_shapes(capsys):
    assert main(["inspect", "llama-3-7b"]) == 2
    err = capsys.readouterr().err
    assert "(did you mean 'llama-3-70b'?)" in err and "llama-3-8b, llama-3.2-1b" in err
