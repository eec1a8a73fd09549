"""Preemption (vLLM's recompute): on a CPU the rows take memory only as they write, so an
`LLM` runs more sequences than its KV room holds at full length, and when their rows
outgrow it the youngest request gives its rows back and waits; admitted again, its prompt
and the tokens it had are prefilled (where its decode steps computed them as a prefill
does), or its prompt is and its tokens are fed back through decode steps. Its answer is
then bit for bit what it is alone."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import zoo
from http_server import InProcess, http
from streams import random_prompts, streamed_apart

from offload import LLM, ConfigError, SamplingParams
from offload.engine.rows import bytes_per_row

LENGTH = 128  # max_model_len (two pages of this model's rows: `Scheduler._pages`)
GREEDY = SamplingParams(temperature=0, max_tokens=100, logprobs=1, ignore_eos=True)
PROMPTED = SamplingParams(
    temperature=0, max_tokens=100, logprobs=1, prompt_logprobs=1, ignore_eos=True
)
SEEDED = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=90, logprobs=1, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return zoo.save_attentive_llm(tmp_path_factory.mktemp("tiny"), num_layers=2)


def _room_for(checkpoint, rows: int) -> int:
    """The bytes of KV cache of `rows` rows of `LENGTH` positions."""
    with LLM(checkpoint) as llm:
        return rows * bytes_per_row(llm.model.config, LENGTH, llm.model.dtype)


def _answers(output) -> list[tuple]:
    """Each sequence's tokens and their logprobs, and the prompt's logprobs (if asked)."""
    prompt = [
        None if e is None else {t: lp.logprob for t, lp in e.items()}
        for e in output.prompt_logprobs or []
    ]
    return [prompt] + [
        (tuple(c.token_ids), tuple(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)))  # noqa: B905
        for c in output.outputs
    ]


@pytest.fixture(scope="module")
def invariant(checkpoint):
    """A batch-invariant LLM with KV room for 8 rows of `LENGTH`, 32 prompts (greedy,
    every fourth sampled: seeded, n=2; some asking their prompt's logprobs, which a
    preempted request does not compute again) and each one's answers alone."""
    room = _room_for(checkpoint, 8)
    with LLM(checkpoint, batch_invariant=True, max_model_len=LENGTH,
             kv_cache_memory_bytes=room) as llm:  # fmt: skip
        prompts = random_prompts(
            llm.model.config.vocab_size, [3 + (i * 7) % 18 for i in range(32)], seed=5
        )
        params = [SEEDED if i % 4 == 3 else PROMPTED if i % 8 == 1 else GREEDY for i in range(32)]
        alone = [
            _answers(llm.generate([p], s, use_tqdm=False)[0])
            for p, s in zip(prompts, params, strict=True)
        ]
        yield llm, prompts, params, alone


def test_32_requests_in_room_for_8_are_preempted_and_answer_as_alone(invariant):
    llm, prompts, params, alone = invariant
    together = llm.generate(prompts, params, use_tqdm=False)
    core = llm._generator.core
    assert core.max_rows >= 40  # (every sequence at once, in room for 8 at full length)
    assert core.scheduler.num_preemptions > 0
    assert [_answers(o) for o in together] == alone


def test_concurrent_streams_in_room_for_8_are_preempted_and_answer_as_alone(invariant):
    """What `offload serve` runs: 24 greedy requests from threads of their own."""
    llm, prompts, params, alone = invariant
    greedy = [i for i in range(32) if params[i] is GREEDY]
    served = streamed_apart(llm, [prompts[i] for i in greedy], GREEDY, _answers)
    assert served == [alone[i] for i in greedy]
    assert llm.serving().core.scheduler.num_preemptions > 0


def test_with_prefix_caching_a_preempted_request_restarts_from_its_held_prompt(checkpoint):
    """On the default setting (prefix caching on): every request completes, some are
    preempted, a preempted request's prompt is found held when it comes back, and each
    answer is bit for bit its answer alone (a held prompt's positions have the bits of
    its prefill: `engine/prompt_attention`)."""
    room = _room_for(checkpoint, 4)
    params = SamplingParams(temperature=0, max_tokens=90, logprobs=1, ignore_eos=True)
    with LLM(checkpoint, max_model_len=LENGTH, kv_cache_memory_bytes=room) as llm:
        vocab = llm.model.config.vocab_size
        prompts = random_prompts(vocab, [17 + i % 8 for i in range(16)], seed=6)  # (a block +)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        scheduler = llm._generator.core.scheduler
        assert scheduler.num_preemptions > 0
        assert all(len(o.outputs[0].token_ids) == 90 for o in outputs)
        assert scheduler.prefixes.hits > 0  # (no two of these prompts share a beginning)
    with LLM(checkpoint, max_model_len=LENGTH, enable_prefix_caching=False) as llm:
        alone = [_answers(llm.generate([p], params, use_tqdm=False)[0]) for p in prompts]
    assert [_answers(o) for o in outputs] == alone


def test_a_preempted_request_prefills_its_tokens_again_and_answers_as_alone(
    checkpoint, monkeypatch
):
    """vLLM's recompute: a decode step computes a token's keys and values as a prefill
    does (`prompt_attention.step_attention`), so a preempted request (one sequence)
    comes back by prefilling its prompt and the tokens it had in one forward, not by
    feeding them through a decode step each; its answer is still bit for bit its answer
    alone (without prefix caching here: nothing held helps)."""
    from offload.engine import scheduler as scheduling

    again = []
    prefilled_again = scheduling._prefilled_again
    monkeypatch.setattr(
        scheduling, "_prefilled_again", lambda r: again.append(prefilled_again(r)) or again[-1]
    )
    room = _room_for(checkpoint, 4)
    params = SamplingParams(temperature=0, max_tokens=90, logprobs=1, ignore_eos=True)
    with LLM(checkpoint, max_model_len=LENGTH, enable_prefix_caching=False) as llm:
        prompts = random_prompts(llm.model.config.vocab_size, [5 + i % 8 for i in range(16)], 8)
        alone = [_answers(llm.generate([p], params, use_tqdm=False)[0]) for p in prompts]
    again.clear()
    with LLM(
        checkpoint, max_model_len=LENGTH, kv_cache_memory_bytes=room, enable_prefix_caching=False
    ) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm._generator.core.scheduler.num_preemptions > 0
    assert [_answers(o) for o in outputs] == alone
    assert max(again) > 1  # (a preempted one prefilled its tokens with its prompt)


def test_a_request_longer_than_the_whole_room_is_refused_in_one_line(checkpoint):
    room = _room_for(checkpoint, 1)
    with LLM(checkpoint, max_model_len=LENGTH, kv_cache_memory_bytes=room) as llm:
        params = SamplingParams(max_tokens=100, n=2)
        with pytest.raises(ConfigError, match=r"KV cache") as caught:
            llm.generate([{"prompt_token_ids": [5] * 20}], params, use_tqdm=False)
        assert "\n" not in str(caught.value)
        assert len(llm.generate(["t3 t4"], SamplingParams(max_tokens=4), use_tqdm=False)) == 1


def test_the_server_answers_32_requests_in_room_for_8_as_alone_and_counts_preemptions(
    invariant,
):
    """Over HTTP (the openai client, 32 at once): each answer is its answer alone, and
    `/metrics` counts the preemptions (vLLM's `vllm:num_preemptions_total`)."""
    llm, prompts, params, alone = invariant
    greedy = [i for i in range(32) if params[i] is GREEDY]
    tokenizer = llm.get_tokenizer()
    server = InProcess(llm)
    try:
        client = server.client()
        before = _metric(server, "vllm:num_preemptions_total")

        def ask(index: int) -> str:
            response = client.completions.create(
                model="tiny", prompt=prompts[index]["prompt_token_ids"], max_tokens=100,
                temperature=0, extra_body={"ignore_eos": True},
            )  # fmt: skip
            return response.choices[0].text

        with ThreadPoolExecutor(len(greedy)) as pool:
            together = list(pool.map(ask, greedy))
        assert together == [
            tokenizer.decode(alone[i][1][0], skip_special_tokens=True) for i in greedy
        ]
        assert _metric(server, "vllm:num_preemptions_total") > before
        assert 0 <= _metric(server, "vllm:kv_cache_usage_perc") <= 1
    finally:
        server.stop()


def _metric(server, name: str) -> float:
    for line in http(server.url + "/metrics")[1].splitlines():
        if line.startswith(name + "{"):
            return float(line.split()[-1])
    raise AssertionError(f"no {name}")


ADDRESS_LIMIT = """
import resource, sys
from offload import LLM, SamplingParams
llm = LLM(sys.argv[1], max_model_len=2048)
size = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + 200 * 2**20, resource.RLIM_INFINITY))
serving = llm.serving(max_num_seqs=256)
out = list(llm.stream("t3 t4", SamplingParams(max_tokens=4)))[-1]
print(serving.core.max_rows, serving.core.scheduler.room is not None, len(out.outputs[0].token_ids))
"""


def test_rows_whose_address_space_is_refused_run_fewer_in_the_same_room(checkpoint):
    """256 rows of 2048 positions need more address space (memory only as written) than
    a limit of 200 MiB above the loaded process leaves: fewer rows run, still sharing the
    room, and answer."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", ADDRESS_LIMIT, str(checkpoint)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows, shared, tokens = done.stdout.split()
    assert 1 <= int(rows) < 256 and shared == "True" and tokens == "4"
    assert "was refused" in done.stderr
