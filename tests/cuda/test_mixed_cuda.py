"""Chunked prefill mixed with decode on a GPU (`engine/mixed_step.py`): a prompt's chunks
ride in the running rows' decode steps (eager, beside the CUDA graphs of the plain
steps), answer as the forwards apart do up to rounding, and offloaded (streamed weights,
KV cache in host memory) bit for bit as resident."""

import pytest
import torch
from forwards import record_forwards

from offload import SamplingParams
from offload.engine import step_runner
from offload.llm.llm import LLM

pytestmark = pytest.mark.cuda
LONG = " ".join(f"t{i % 40 + 3}" for i in range(37))
PROMPTS = ["t3 t4", "t5 t6 t7", LONG, "t9 t10 t11 t12 t13"]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)


def _generate(checkpoint, **flags):
    llm = LLM(checkpoint, device="cuda", max_num_batched_tokens=4, **flags)
    try:
        return llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        llm.close()
        torch.cuda.empty_cache()


def _logprobs(output) -> list[float]:
    return [lp.logprob for entry in output.outputs[0].logprobs for lp in entry.values()]


def test_mixed_forwards_on_a_gpu_answer_as_apart_and_offloaded_as_resident(checkpoint, monkeypatch):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step_runner, "can_mix", lambda model, cache: False)
        apart = _generate(checkpoint)
    events = record_forwards(monkeypatch)
    resident = _generate(checkpoint)
    assert sum(e[0] == "mixed" for e in events) >= 10
    offloaded = _generate(
        checkpoint, kv_offload=True, offload_group_size=1, offload_prefetch_step=2
    )
    for mine, theirs in zip(offloaded, resident, strict=True):
        assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert _logprobs(mine) == _logprobs(theirs)
    for mine, theirs in zip(resident, apart, strict=True):
        # (the first tokens agree; a near tie later may part at bfloat16 rounding)
        assert mine.outputs[0].token_ids[:4] == theirs.outputs[0].token_ids[:4]
        first = [_logprobs(o)[0] for o in (mine, theirs)]
        assert first[0] == pytest.approx(first[1], abs=5e-2)
