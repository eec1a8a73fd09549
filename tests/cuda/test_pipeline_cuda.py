"""Pipeline parallel on a GPU: two ranks (processes) on the one device, each holding its
stage there, the hidden states and logits through host memory over gloo: one process's
tokens and logprobs, greedy and seeded, resident and with a stage's weights prefetched."""

import pytest
import torch
import zoo

from offload import SamplingParams
from offload.llm.llm import LLM

pytestmark = pytest.mark.cuda
PROMPTS = [{"prompt_token_ids": [1, 5, 9, 14, 3]}, {"prompt_token_ids": [2, 7, 7, 100, 20, 30]}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(zoo.save_attentive_llm(tmp_path_factory.mktemp("pp") / "m", num_layers=6))


def _answers(checkpoint, **flags):
    answers = []
    with LLM(checkpoint, device="cuda", dtype="float32", **flags) as llm:
        for params in (
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=1),
        ):
            for out in llm.generate(PROMPTS, params, use_tqdm=False):
                answers.append((out.outputs[0].token_ids, out.outputs[0].logprobs))
    torch.cuda.empty_cache()
    return answers


@pytest.mark.parametrize("flags", [{}, {"offload_group_size": 1, "offload_prefetch_step": 1}])
def test_two_gpu_ranks_give_one_process_s_bits(checkpoint, flags):
    # (eager: a stage's sends and receives are not captured in CUDA graphs; the reference
    # eager too, so that both run the same kernels)
    expected = _answers(checkpoint, enforce_eager=True, **flags)
    assert _answers(checkpoint, enforce_eager=True, pipeline_parallel_size=2, **flags) == expected
