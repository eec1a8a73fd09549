"""Chunked prefill by default on a CPU (`engine/chunk_pace.py`, `engine/mixed_turn.py`):
with no `max_num_batched_tokens`, prompts that arrive while rows decode ride in their
decode steps, as many tokens a turn as the measured pace gives. The pace depends on time,
so whatever it gives must not move a bit: every answer is its answer alone, however its
prompt was cut and whoever rode beside it."""

from __future__ import annotations

import random

import pytest
from forwards import record_forwards
from streams import RIDING_LENGTHS, RIDING_STOPS, answer_of, random_prompts

from offload import LLM, SamplingParams
from offload.engine.chunk_pace import ChunkPace
from offload.quant import row_dot

LENGTHS, STOPS = RIDING_LENGTHS, RIDING_STOPS


@pytest.fixture(autouse=True)
def _kernels_built():
    if row_dot.library() is None:
        pytest.skip("no C compiler here: prompts are not cut while rows decode by default")


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2, ignore_eos=True)


@pytest.mark.parametrize("seed", [0, 1])
def test_any_paced_budget_answers_as_alone(short_gguf, seed, monkeypatch):
    with LLM(
        short_gguf, max_model_len=256, max_num_seqs=4, enforce_eager=True,
        enable_prefix_caching=False,
    ) as llm:  # fmt: skip
        prompts = random_prompts(llm.model.config.vocab_size, LENGTHS, seed=seed)
        params = [_params(n) for n in STOPS]
        alone = [
            answer_of(llm.generate([p], q, use_tqdm=False)[0])
            for p, q in zip(prompts, params, strict=True)
        ]
        budgets = random.Random(seed)
        monkeypatch.setattr(
            ChunkPace,
            "budget",
            lambda self, waiting, decoding: budgets.choice((1, 3, 17, 40, 500, 500)),
        )
        events = record_forwards(monkeypatch)
        together = [answer_of(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert together == alone
    mixed = [e for e in events if e[0] == "mixed"]
    # Prompts rode in decode steps, cut inside (a chunk shorter than every prompt that is
    # not a whole one), and whole ones together in one step.
    assert len(mixed) >= 3
    assert any(c not in LENGTHS for e in mixed for c in e[2:])
    assert any(len(e) > 3 for e in mixed)


def test_by_default_a_long_prompt_arriving_while_rows_decode_rides_in_their_steps(
    short_gguf, monkeypatch
):
    """No flag: the first prompts prefill whole (nothing decodes); the long one, which
    waits for a row, goes through the running row's decode steps, as many tokens a turn
    as the pace measures."""
    with LLM(short_gguf, max_model_len=256, max_num_seqs=2, enforce_eager=True) as llm:
        prompts = random_prompts(llm.model.config.vocab_size, (4, 6, 200), seed=3)
        params = [_params(2), _params(40), _params(3)]
        alone = answer_of(llm.generate(prompts[2:], params[2], use_tqdm=False)[0])
        events = record_forwards(monkeypatch)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert answer_of(outputs[2]) == alone
    mixed = [e for e in events if e[0] == "mixed"]
    assert sum(c for e in mixed for c in e[2:]) == 200 and all(e[1] == 1 for e in mixed)
