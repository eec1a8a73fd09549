"""Speculative decoding on a GPU (`StepRunner.verify`, eager beside the CUDA graphs of the
plain steps): n-gram guesses scored in one forward keep the tokens of decoding without
them, resident and offloaded (streamed weights, KV cache in host memory), with fewer
forwards; offloaded, bit for bit the resident speculation."""

import pytest
import torch

from offload import SamplingParams
from offload.llm.llm import LLM

pytestmark = pytest.mark.cuda
REPEATED = " ".join(["t3 t4 t5 t6 t7"] * 6)
PROMPTS = ["t3 t4", REPEATED, "t9 t10 t11 t12 t13"]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


def _generate(checkpoint, prompts=PROMPTS, **flags):
    llm = LLM(checkpoint, device="cuda", **flags)
    try:
        return llm.generate(prompts, PARAMS, use_tqdm=False), llm.transfer_stats()
    finally:
        llm.close()
        torch.cuda.empty_cache()


def _logprobs(output) -> list[float]:
    return [lp.logprob for entry in output.outputs[0].logprobs for lp in entry.values()]


def test_speculation_on_a_gpu_keeps_the_tokens_and_offloaded_the_bits(checkpoint, monkeypatch):
    from offload.engine import speculative

    monkeypatch.setattr(
        speculative.Pace, "guesses", lambda self: max(self.depths)
    )  # (always guess)
    plain, _ = _generate(checkpoint)
    resident, moved = _generate(checkpoint, speculative_config=NGRAM)
    assert moved.num_spec_accepted_tokens > 0
    offloaded, _ = _generate(
        checkpoint, speculative_config=NGRAM, kv_offload=True, offload_group_size=1,
        offload_prefetch_step=2,
    )  # fmt: skip
    for mine, theirs in zip(offloaded, resident, strict=True):
        assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert _logprobs(mine) == _logprobs(theirs)
    for mine, theirs in zip(resident, plain, strict=True):
        # (the first tokens agree; a near tie later may part at bfloat16 rounding)
        assert mine.outputs[0].token_ids[:4] == theirs.outputs[0].token_ids[:4]


def test_a_tree_on_a_gpu_offloaded_gives_the_resident_tree_s_bits(checkpoint, monkeypatch):
    """A tree of guesses (`tree_budget`): its kept path's KV columns moved on the device
    and in host memory (KV offload) alike."""
    from offload.engine import speculative

    monkeypatch.setattr(speculative.Pace, "guesses", lambda self: max(self.depths))
    tree = {**NGRAM, "tree_budget": 10}
    branching = [" ".join(f"t3 t4 t{i}" for i in range(5, 12)) + " t3 t4", REPEATED]
    resident, moved = _generate(checkpoint, branching, speculative_config=tree)
    assert moved.num_spec_drafts > 0
    offloaded, _ = _generate(
        checkpoint, branching, speculative_config=tree, kv_offload=True, offload_group_size=1,
        offload_prefetch_step=2,
    )  # fmt: skip
    for mine, theirs in zip(offloaded, resident, strict=True):
        assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert _logprobs(mine) == _logprobs(theirs)
