"""LLM.generate on a real GPU: CUDA-graph decode against eager, every offload setting,
KV cache in host memory, and a device capped with set_per_process_memory_fraction."""

import contextlib
import gc

import pytest
import torch

from offload import SamplingParams
from offload.llm.llm import LLM

pytestmark = pytest.mark.cuda
PROMPTS = ["t5 t6 t7 t8 t9 t10", "t100 t200", "t3 t4 t5 t6 t7 t8 t9 t10 t11 t12 t13"]
# 80 tokens: the KV graphs go past their first bucket (64 positions) into the next one.
GREEDY = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
# A random model's greedy text repeats itself; sampling (seeded, outside the graph)
# follows the exact probabilities, so it also catches small differences in the logits.
SAMPLED = SamplingParams(temperature=1.0, seed=7, max_tokens=80, ignore_eos=True)
SETTINGS = {
    "resident": {},
    "uva": {"cpu_offload_gb": 0.2},
    "prefetch": {"offload_group_size": 1, "offload_prefetch_step": 2},
    "prefetch-8-2": {"offload_group_size": 8, "offload_num_in_group": 2},
    "kv-cache": {"kv_offload": True},
    "prefetch+kv-cache": {"offload_group_size": 1, "offload_prefetch_step": 2, "swap_space": 1},
}


def _tokens(llm, prompts=PROMPTS):
    return [
        o.outputs[0].token_ids
        for params in (GREEDY, SAMPLED)
        for o in llm.generate(prompts, params)
    ]


def _free():
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def eager_resident(checkpoint):
    llm = LLM(checkpoint, device="cuda", enforce_eager=True)
    batched, alone = _tokens(llm), _tokens(llm, PROMPTS[1:2])
    del llm
    _free()
    return batched, alone


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_graph_decode_is_exact(checkpoint, eager_resident, setting):
    llm = LLM(checkpoint, device="cuda", **SETTINGS[setting])
    batched, alone = eager_resident
    assert _tokens(llm) == batched
    assert _tokens(llm, PROMPTS[1:2]) == alone
    moved = llm.transfer_stats()
    assert moved.num_graph_replays > 0  # the decode really ran as graph replays
    if "kv" in setting:
        assert moved.kv_copied_bytes > 0 and moved.kv_written_back_bytes > 0
    if setting.startswith("prefetch"):
        assert moved.weight_copied_bytes > 0
    del llm
    _free()


def test_enforce_eager_runs_no_graph(checkpoint, eager_resident):
    llm = LLM(checkpoint, device="cuda", enforce_eager=True, kv_offload=True)
    assert _tokens(llm) == eager_resident[0]
    assert llm.transfer_stats().num_graph_replays == 0
    del llm
    _free()


@contextlib.contextmanager
def _capped(gib: float):
    """The process may allocate at most `gib` GiB on the GPU (the allocator enforces it);
    the peak is measured from inside."""
    total = torch.cuda.get_device_properties(0).total_memory
    _free()
    torch.cuda.set_per_process_memory_fraction(gib * 2**30 / total)
    try:
        torch.cuda.reset_peak_memory_stats()
        yield
    finally:
        _free()
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_a_capped_device_runs_a_model_larger_than_it(checkpoint, eager_resident):
    """With the process capped below the model's size, the fit check sees the cap, picks
    the offload itself, and the allocator (which enforces the cap) never runs out."""
    with _capped(0.40):
        llm = LLM(
            checkpoint, device="cuda", max_model_len=512, cpu_offload_gb="auto", kv_offload=True
        )
        assert llm.offloader.offloaded_bytes > 0
        assert _tokens(llm) == eager_resident[0]
        assert torch.cuda.max_memory_reserved() <= 0.40 * 2**30
        del llm


def test_chunked_prefill_on_a_capped_device_at_full_context(checkpoint):
    """The SmolLM2-shaped model at its longest context with the KV cache in host memory,
    under a 0.25 GiB cap (which fits SmolLM2's 8192 positions only with the prefill in
    chunks of 256 tokens); the tokens are those of the same chunked run, not offloaded."""
    chunked = LLM(checkpoint, device="cuda", max_num_batched_tokens=256)
    expected = _tokens(chunked)
    del chunked
    with _capped(0.25):
        llm = LLM(
            checkpoint, device="cuda", max_num_batched_tokens=256, kv_offload=True,
            cpu_offload_gb="auto",
        )  # fmt: skip
        assert llm.max_model_len >= 2048 and llm.offloader.offloaded_bytes > 0
        assert _tokens(llm) == expected
        assert torch.cuda.max_memory_reserved() <= 0.25 * 2**30
        del llm
