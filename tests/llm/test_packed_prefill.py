"""Prompts admitted in one turn are prefilled in one forward on a CPU (`mixed_step`,
`EngineCore._turn`): an offloaded weight crosses the link once for all of them, each
prompt's tokens and logprobs are its own alone, a prompt that shares a new beginning with
one of them waits for its forward and starts from its row, and a forward that fails fails
its requests only."""

import pytest
import zoo

from offload import OffloadError, SamplingParams
from offload.engine import prompt_attention, step_runner
from offload.llm.llm import LLM
from offload.quant import row_dot

FIRST = SamplingParams(temperature=0, max_tokens=1, logprobs=3)
GREEDY = SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True)
PREFETCH = {"offload_group_size": 1, "offload_prefetch_step": 1}
PROMPTS = [{"prompt_token_ids": [5 + (i * 11 + j * 7) % 120 for j in range(n)]} for i, n in
           enumerate((9, 3, 17, 6))]  # fmt: skip


@pytest.fixture(autouse=True)
def _kernels_built():
    if row_dot.library() is None:
        pytest.skip("no C compiler here: prompts prefill one at a time")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return zoo.save_attentive_llm(tmp_path_factory.mktemp("tiny"), num_layers=3)


def _answers(outputs) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def _alone(llm: LLM, prompts, params) -> list[tuple]:
    return [_answers(llm.generate([p], params, use_tqdm=False))[0] for p in prompts]


def test_prompts_admitted_together_cross_the_link_once_and_answer_as_alone(checkpoint):
    with LLM(checkpoint, device="cpu", dtype="float32", **PREFETCH) as llm:
        alone = _alone(llm, PROMPTS, FIRST)
        before = llm.transfer_stats().weight_copied_bytes
        llm.generate(PROMPTS[:1], FIRST, use_tqdm=False)
        one = llm.transfer_stats().weight_copied_bytes - before  # (one forward's)
        assert one > 0
        together = _answers(llm.generate(PROMPTS, FIRST, use_tqdm=False))
        assert llm.transfer_stats().weight_copied_bytes - before == 2 * one
        assert together == alone
        # (and decoding on from there, each prompt as alone)
        assert _answers(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == _alone(
            llm, PROMPTS, GREEDY
        )


def test_each_prompt_s_mask_is_read_once_a_forward_not_once_a_layer(checkpoint, monkeypatch):
    """Each prompt of a packed forward has a mask of its own, the same tensor in every
    layer: its columns are read once (they were read per layer: ~15% of a packed prefill
    of 14 short prompts)."""
    reads = []
    bounds = prompt_attention._bounds

    def counted(mask, *shape):
        reads.append(shape)
        return bounds(mask, *shape)

    with LLM(checkpoint, device="cpu", dtype="float32", enforce_eager=True) as llm:
        alone = _alone(llm, PROMPTS, FIRST)
        monkeypatch.setattr(prompt_attention, "_bounds", counted)
        assert _answers(llm.generate(PROMPTS, FIRST, use_tqdm=False)) == alone
    assert len(reads) == len(PROMPTS)  # (3 layers: 12 before)


def test_a_prompt_sharing_a_new_beginning_waits_for_its_forward_and_reuses_it(checkpoint):
    """Four prompts beginning with the same 64 new tokens, submitted together: the first
    is computed alone, the other three start from its row (in one forward together)."""
    shared = [7 + (j * 13) % 110 for j in range(64)]
    prompts = [{"prompt_token_ids": [*shared, 20 + i, 30 + i]} for i in range(4)]
    with LLM(checkpoint, device="cpu", dtype="float32", enable_prefix_caching=False) as llm:
        alone = _alone(llm, prompts, GREEDY)
    with LLM(checkpoint, device="cpu", dtype="float32") as llm:
        together = _answers(llm.generate(prompts, GREEDY, use_tqdm=False))
        hits = llm._generator.core.scheduler.prefixes.hits
    assert together == alone
    assert hits == 3 * 64


def test_a_failing_forward_fails_its_requests_and_the_engine_goes_on(checkpoint, monkeypatch):
    with LLM(checkpoint, device="cpu", dtype="float32") as llm:
        alone = _alone(llm, PROMPTS, GREEDY)
        packed = step_runner.StepRunner.prefill_packed

        def fails(self, chunks):
            raise OSError("the disk failed")

        monkeypatch.setattr(step_runner.StepRunner, "prefill_packed", fails)
        with pytest.raises((OSError, OffloadError), match="the disk failed"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        monkeypatch.setattr(step_runner.StepRunner, "prefill_packed", packed)
        assert _answers(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == alone
        assert llm._generator.core.scheduler.unheld == []
