"""Chunked prefill mixed with decode (`engine/mixed_step.py`): a prompt's chunk rides in
the running rows' decode step, one forward where there were two, and every row's results
are those of the two forwards apart up to rounding."""

from __future__ import annotations

import queue
import threading

import pytest
import torch
import zoo
from forwards import record_forwards
from streams import last_output

from offload import LLM, SamplingParams
from offload.engine import mixed_step, step_jobs, step_runner
from offload.engine.step_runner import StepRunner

LONG = " ".join(f"t{i % 40 + 3}" for i in range(37))  # 37 tokens: 10 chunks of 4
PROMPTS = ["t3 t4", "t5 t6 t7", LONG, "t9 t10 t11 t12 t13"]
PARAMS = SamplingParams(
    temperature=0, max_tokens=24, ignore_eos=True, logprobs=2, prompt_logprobs=2
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return zoo.save_attentive_llm(tmp_path_factory.mktemp("tiny"))


def _generate(checkpoint, **flags):
    with LLM(checkpoint, max_num_batched_tokens=4, **flags) as llm:
        return llm.generate(PROMPTS, PARAMS, use_tqdm=False)


def _values(entries) -> tuple[list[int], list[float]]:
    """The tokens and logprobs of logprob entries, flat."""
    pairs = [(t, lp.logprob) for entry in entries if entry is not None for t, lp in entry.items()]
    return [t for t, _ in pairs], [value for _, value in pairs]


def _assert_close(got, expected, exact: bool) -> None:
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids
        pairs = [
            (_values(mine.outputs[0].logprobs), _values(theirs.outputs[0].logprobs)),
            (_values(mine.prompt_logprobs), _values(theirs.prompt_logprobs)),
        ]
        for (tokens, values), (other_tokens, others) in pairs:
            assert tokens == other_tokens
            if exact:
                assert values == others
            else:
                assert torch.allclose(torch.tensor(values), torch.tensor(others), atol=2e-5, rtol=0)


@pytest.fixture(scope="module")
def apart(checkpoint):
    """The outputs with every chunk prefilled in a forward of its own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step_runner, "can_mix", lambda model, cache: False)
        return _generate(checkpoint)


def test_a_prompts_chunks_ride_in_the_decode_steps_and_answer_as_apart(
    checkpoint, apart, monkeypatch
):
    events = record_forwards(monkeypatch)
    got = _generate(checkpoint)
    # A running row's steps are its decode step's bits whether a chunk rides along or not
    # (`mixed_step._decode_sdpa`): the first prompt decodes beside every later chunk, the
    # second's 3 columns are one chunk. A prompt prefilled in several chunks reads other
    # widths mixed than apart: its last bits may move.
    _assert_close(got[:2], apart[:2], exact=True)
    _assert_close(got[2:], apart[2:], exact=False)
    # The first prompt prefills alone (no row decodes yet); once its row decodes, every
    # later chunk (the second prompt's 3 columns, the long one's 10 chunks, the last
    # one's 2) rides in the running rows' decode step: one forward a turn, with every
    # running row's token, so the rows keep their pace while a prompt comes in.
    assert events[:2] == [("prefill", 2), ("decode", 1)]
    chunks = [(1, 3), *[(2, 4)] * 9, (2, 1), (3, 4), (3, 1)]
    assert events[2:15] == [("mixed", *chunk) for chunk in chunks]
    assert all(e[0] == "decode" for e in events[15:])


def test_kv_offload_and_offloaded_weights_mix_as_resident(checkpoint, monkeypatch):
    """The same mixed forwards over the KV cache in host memory and over streamed
    weights: bit for bit the resident ones."""
    resident = _generate(checkpoint)
    events = record_forwards(monkeypatch)
    got = _generate(checkpoint, kv_offload=True, offload_group_size=1, offload_prefetch_step=2)
    assert sum(e[0] == "mixed" for e in events) == 13
    _assert_close(got, resident, exact=True)


def test_a_turn_runs_its_forwards_apart_while_a_compile_traces_the_model(
    checkpoint, apart, monkeypatch
):
    """A compile on the step jobs' thread reads the model's attention implementation,
    which a mixed forward swaps: while one of the model's jobs runs (holding
    `StepJobs.running`, which the runner passes), the turn's two forwards run apart."""
    events = record_forwards(monkeypatch)
    busy, mixing = threading.Lock(), mixed_step.mixing
    monkeypatch.setattr(
        mixed_step, "mixing", lambda model, window, jobs: mixing(model, window, busy)
    )
    with busy:
        got = _generate(checkpoint)
    assert ("apart",) in events and not any(e[0] == "mixed" for e in events)
    _assert_close(got, apart, exact=False)


def test_a_mixed_forward_that_fails_fails_its_requests_and_the_rest_go_on(checkpoint, monkeypatch):
    """A fault in a mixed forward (a disk error, say) fails the requests in it, the running
    rows' and the arriving prompt's, with that error; the core goes on with the others."""
    calls, mixed_of = [], StepRunner.packed

    def failing(self, rows, chunks):
        calls.append(len(rows))
        if len(calls) == 3:
            raise OSError("injected read error")
        return mixed_of(self, rows, chunks)

    monkeypatch.setattr(StepRunner, "packed", failing)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(checkpoint, max_num_batched_tokens=4) as llm:
        serving = llm.serving(8)
        tokenizer = llm.get_tokenizer()
        queues = [queue.Queue() for _ in PROMPTS]
        requests = [
            serving.prepare(p, tokenizer(p).input_ids, params, q.put)
            for p, q in zip(PROMPTS, queues, strict=True)
        ]
        serving.core.submit_all(requests)
        outcomes = []
        for q in queues:
            try:
                outcomes.append(last_output(q).outputs[0].token_ids)
            except OSError as error:
                outcomes.append(str(error))
        again = llm.generate(PROMPTS[-1:], params, use_tqdm=False)[0].outputs[0].token_ids
    # The third mixed forward ran the first two prompts' rows with the long prompt's chunk.
    assert calls[2] == 2
    assert outcomes[:3] == ["injected read error"] * 3
    assert outcomes[3] == again and len(again) == 8


def test_only_what_a_mixed_forward_can_split_mixes():
    """A mixed forward swaps the config's attention name for its own (`mixing`): only
    for SDPA attention named by the model's own config, rows without sliding windows and
    rotary embeddings that do not depend on the batch; the name is back after it."""
    from types import SimpleNamespace

    from offload.engine.mixed_step import NAME, can_mix, mixing

    model, rows = zoo.build("llama"), SimpleNamespace(masks=None)
    assert can_mix(model, rows)
    assert not can_mix(model, SimpleNamespace(masks=object()))  # (sliding windows)
    model.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0}
    assert not can_mix(model, rows)
    eager = zoo.build("llama")
    eager.config._attn_implementation = "eager"
    assert not can_mix(eager, rows)
    seen = []
    with mixing(eager, object(), None) as mixes:
        seen.append((mixes, eager.config._attn_implementation))
    assert seen == [(True, NAME)] and eager.config._attn_implementation == "eager"


def test_a_step_job_holds_its_jobs_running_lock_while_it_runs():
    """What a mixed forward waits for no longer than a try: `StepJobs.running`, held
    while a job (a trace) runs and free before and after."""
    jobs = step_jobs.StepJobs()
    seen = []
    assert not jobs.running.locked()
    jobs.submit("shape", lambda: seen.append(jobs.running.locked()))
    assert jobs.wait(60)
    assert seen == [True] and not jobs.running.locked()
