"""Automatic prefix caching (`enable_prefix_caching`, on by default as in vLLM's V1
engine): a prompt that begins as one the rows hold starts from those columns. Its tokens
and logprobs are bit for bit those of the engine without the cache; offloaded, its bits
are the resident engine's with the cache; and the held prefix is really used (fewer tokens
computed)."""

import queue

import pytest
import zoo
from streams import last_output

from offload import ConfigError, SamplingParams
from offload.llm.llm import LLM

SHARED = " ".join(f"t{3 + (i * 7) % 40}" for i in range(70))  # (4 whole blocks and more)
TURNS = [SHARED + " t5 t6", SHARED + " t5 t6 t9 t11 t2", SHARED + " t30", "t4 " + SHARED]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
OFFLOADED = {
    "prefetch": {"offload_group_size": 1, "offload_prefetch_step": 2},
    "disk": {"cpu_memory_gb": 0, "disk_io": "direct"},
    "kv offload": {"kv_offload": True},  # (the rows, and so the held prompts, in host memory)
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return zoo.save_attentive_llm(tmp_path_factory.mktemp("tiny"))


def _served(llm, prompts):
    """The first two prompts submitted together (the second starts from the first's row
    while it runs), then each other one after the last finished (from a row whose
    request is done): their outputs, and the engine's prefix counters (queries, hits)."""
    serving = llm.serving(4)
    tokenizer = llm.get_tokenizer()
    outputs = []
    for batch in (prompts[:2], *([p] for p in prompts[2:])):
        queues = [queue.Queue() for _ in batch]
        requests = [
            serving.prepare(p, tokenizer(p).input_ids, GREEDY, q.put)
            for p, q in zip(batch, queues, strict=True)
        ]
        serving.core.submit_all(requests)
        outputs += [last_output(q).outputs[0] for q in queues]
    held = serving.core.scheduler.prefixes
    return outputs, (held.queries, held.hits) if held is not None else None


def _logprobs(output):
    return [{t: lp.logprob for t, lp in entry.items()} for entry in output.logprobs]


@pytest.fixture(scope="module")
def cached(checkpoint):
    with LLM(checkpoint) as llm:
        assert llm.prefix_caching  # (the default)
        return _served(llm, TURNS)


def test_a_held_prefix_is_used_and_gives_the_tokens_of_no_cache(checkpoint, cached):
    outputs, (queries, hits) = cached
    ids = _ids(checkpoint)
    assert queries == sum(len(prompt) for prompt in ids)
    # The 2nd prompt begins with all of the 1st (all of it reused), the 3rd with their 70
    # shared words (whole blocks of them reused); the 4th begins otherwise: nothing.
    assert hits == len(ids[0]) + _common(ids[2], ids[1]) // 16 * 16 > 70 + 64
    with LLM(checkpoint, enable_prefix_caching=False) as llm:
        plain, counters = _served(llm, TURNS)
    assert counters is None
    for got, expected in zip(outputs, plain, strict=True):  # (bit for bit: prompt_attention)
        assert got.token_ids == expected.token_ids
        assert _logprobs(got) == _logprobs(expected)


def _ids(checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return [tokenizer(prompt).input_ids for prompt in TURNS]


def _common(a, b):
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)


@pytest.mark.parametrize("setting", list(OFFLOADED))
def test_offloaded_with_the_cache_is_bitwise_the_resident_with_it(checkpoint, cached, setting):
    outputs, counters = cached
    with LLM(checkpoint, **OFFLOADED[setting]) as llm:
        got, got_counters = _served(llm, TURNS)
        moved = llm.transfer_stats()
    assert got_counters == counters
    assert moved.weight_copied_bytes + moved.disk_read_bytes + moved.kv_moved_bytes > 0
    for mine, theirs in zip(got, outputs, strict=True):
        assert mine.token_ids == theirs.token_ids
        assert _logprobs(mine) == _logprobs(theirs)


def test_enable_prefix_caching_is_checked(checkpoint):
    with pytest.raises(ConfigError, match=r"^enable_prefix_caching must be True or False"):
        LLM(checkpoint, enable_prefix_caching="yes")
    with pytest.raises(ConfigError, match=r"^enable_prefix_caching=True with batch_invariant"):
        LLM(checkpoint, enable_prefix_caching=True, batch_invariant=True)


def test_generate_keeps_the_prompts_between_calls_and_gives_back_the_rest(checkpoint):
    """As vLLM's `LLM`: a call whose prompt begins with an earlier call's starts from it
    (a chat's next turn); between calls the rows keep only the columns a later prompt may
    reuse (the prompt, and the answer where the decode steps computed it as a prefill
    would), the rest of what they wrote is given back (reads as zeros)."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    with LLM(checkpoint, enable_prefix_caching=False) as plain:
        expected = [plain.generate(p, params, use_tqdm=False)[0].outputs[0] for p in TURNS[:2]]
    with LLM(checkpoint) as llm:
        first = llm.generate(TURNS[0], params, use_tqdm=False)[0].outputs[0]
        core = llm._generator.core
        rows = core.runner.cache
        held = core.scheduler.held_columns()
        prompt_length = len(_ids(checkpoint)[0])
        written = prompt_length + len(first.token_ids) - 1  # (the last token is not fed)
        assert held[0] == written
        keys = rows.cache.layers[0].all_keys  # [rows, heads, columns, dim]
        assert keys[0, :, :written].abs().sum() > 0  # (kept)
        assert not keys[0, :, written:].any()  # (the rest given back)
        second = llm.generate(TURNS[1], params, use_tqdm=False)[0].outputs[0]
        # (it parts from the held answer: reused to the held prompt's end)
        assert core.scheduler.prefixes.hits == prompt_length
    for got, want in zip((first, second), expected, strict=True):
        assert got.token_ids == want.token_ids


@pytest.mark.parametrize("setting", ["resident", *OFFLOADED])
def test_a_next_turn_reuses_the_answer_and_gives_the_tokens_of_no_cache(checkpoint, setting):
    """A decode step computes a token's keys and values with the prefill's attention
    kernel (`prompt_attention.step_attention`), so a prompt that goes on from an answer
    (a chat's next turn) reuses the answer's columns too, and its tokens and logprobs are
    still bit for bit those of the engine without the cache."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    flags = OFFLOADED.get(setting, {})
    outputs = {}
    for caching in (True, False):
        with LLM(checkpoint, enable_prefix_caching=caching, **flags) as llm:
            first = llm.generate(TURNS[0], params, use_tqdm=False)[0]
            ids = first.prompt_token_ids + list(first.outputs[0].token_ids) + [5, 7, 9]
            second = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
            outputs[caching] = (first.outputs[0], second.outputs[0])
            if caching:
                # (all it wrote: the prompt and all but the answer's last token)
                assert llm._generator.core.scheduler.prefixes.hits == len(ids) - 4
    for got, want in zip(outputs[True], outputs[False], strict=True):
        assert got.token_ids == want.token_ids
        assert _logprobs(got) == _logprobs(want)


@pytest.mark.slow  # (a compile: out of the quick subset)
def test_a_compiled_step_s_answer_is_reused_with_the_bits_of_no_cache(
    checkpoint, monkeypatch, tmp_path
):
    """The same through the compiled decode step (its attention is an opaque op that
    calls the same kernel: `step_order._attention`)."""
    from offload.engine import cpu_linear, cpu_step

    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(cpu_step.ENV, "wait")  # (the suite turns the compiled step off)
    monkeypatch.setattr(cpu_linear, "PAYS_BYTES", 0)  # (the tiny model's step compiled too)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompt = {"prompt_token_ids": [5, 9, 14, 3, 27, 8, 11] * 3}
    with LLM(checkpoint, device="cpu") as llm:
        first = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        ids = prompt["prompt_token_ids"] + list(first.token_ids) + [5, 7, 9]
        second = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
        assert llm.transfer_stats().num_compiled_steps > 0
        assert llm._generator.core.scheduler.prefixes.hits == len(ids) - 4
    with LLM(checkpoint, device="cpu", enable_prefix_caching=False, enforce_eager=True) as plain:
        expected = [
            plain.generate(p, params, use_tqdm=False)[0].outputs[0]
            for p in (prompt, {"prompt_token_ids": ids})
        ]
    for got, want in zip((first, second), expected, strict=True):
        assert got.token_ids == want.token_ids
        assert _logprobs(got) == _logprobs(want)
