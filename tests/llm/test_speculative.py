"""Speculative decoding (`engine/speculative.py`, `StepRunner.verify`): guesses scored in
one forward give the tokens the model gives without speculation — greedy and sampled,
alone and batched, resident and offloaded — with fewer forwards."""

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from offload import SamplingParams
from offload.cli.main import main
from offload.engine import speculative
from offload.engine.speculative import SpeculativeConfig, lookup
from offload.errors import ConfigError
from offload.llm.llm import LLM

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}
PROMPTS = [
    "The cat sat on the mat. The dog sat on the log. " * 3 + "Say it again:",
    "List the numbers from 1 to 30: 1, 2, 3, 4,",
    "What is the capital of France?",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, logprobs=2)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=40, logprobs=2)
SETTINGS = {
    "resident": {},
    "prefetch": {"offload_group_size": 1, "offload_prefetch_step": 2},
    "disk": {"cpu_memory_gb": 0, "disk_io": "direct"},
    "kv offload": {"kv_offload": True},
}


# -- the config, as vLLM users write it ----------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ({}, None),
        ("", None),
        ({"method": "ngram", "num_speculative_tokens": 4}, SpeculativeConfig("ngram", 4)),
        ({"method": "ngram"}, SpeculativeConfig("ngram", None)),  # (k as it pays: `Pace`)
        (NGRAM, SpeculativeConfig("ngram", 4, None, 1, 3)),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}',
         SpeculativeConfig("ngram", 2, None, 4, 4)),
        ({"model": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_min": 2},
         SpeculativeConfig("ngram", 3, None, 2, 2)),
        ({"model": "/m", "num_speculative_tokens": 5},
         SpeculativeConfig("draft_model", 5, "/m")),
        ({"method": "draft_model", "model": "/m", "num_speculative_tokens": 1, "quantization": "gguf"},
         SpeculativeConfig("draft_model", 1, "/m", quantization="gguf")),
    ],
)  # fmt: skip
def test_the_config_reads_vllms_shapes(value, expected):
    assert SpeculativeConfig.of(value) == expected


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ({"method": "eagle", "num_speculative_tokens": 3}, "'eagle' is not available here"),
        ({"method": "medusa", "num_speculative_tokens": 3}, "'medusa' is not available here"),
        ({"method": "beam", "num_speculative_tokens": 3}, "method must be one of ngram"),
        ({"method": "draft_model", "num_speculative_tokens": 3}, "'draft_model' needs a 'model'"),
        ({"model": "x", "num_speculative_tokens": 3, "prompt_lookup_max": 2}, "prompt_lookup_max is for method 'ngram'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "from 1 to 64, got 0"),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, "from 1 to 64, got 2.5"),
        ({**NGRAM, "prompt_lookup_min": 4}, "prompt_lookup_min (4) is more than prompt_lookup_max (3)"),
        ({**NGRAM, "prompt_lookup_max": 0}, "prompt_lookup_max must be an integer >= 1, got 0"),
        ({**NGRAM, "tree": 8}, "unknown key 'tree'"),
        ({**NGRAM, "model": "x"}, "'ngram' takes no 'model'"),
        ({**NGRAM, "quantization": "gguf"}, "'ngram' takes no 'model' or 'quantization'"),
        ("{not json", "not JSON"),
        ([1, 2], "must be a mapping"),
    ],
)  # fmt: skip
def test_a_bad_config_is_one_line_naming_it(value, needle):
    with pytest.raises(ConfigError, match="speculative_config") as caught:
        SpeculativeConfig.of(value)
    assert needle in str(caught.value) and "\n" not in str(caught.value)


def test_batch_invariance_with_speculation_is_refused_before_loading():
    with pytest.raises(ConfigError, match="speculative_config with batch_invariant"):
        LLM("/nonexistent", batch_invariant=True, speculative_config=NGRAM)


def test_the_cli_refuses_a_bad_config_in_one_line(capsys):
    assert main(["generate", "--speculative-config", '{"method": "eagle3"}']) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("offload: error: speculative_config:") and "\n" not in err


# -- prompt lookup -----------------------------------------------------------------------


def test_lookup_takes_the_longest_suffix_and_its_latest_occurrence():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert lookup(tokens, 1, 3, 3) == [7, 8, 5]  # "2 3" last seen before 7 8 5 (not 9)
    assert lookup(tokens, 3, 3, 3) == []  # "5 2 3" occurs nowhere earlier
    assert lookup([4, 4, 4], 1, 2, 5) == [4]  # (overlapping: what followed the first "4 4")
    assert lookup([1, 2], 1, 1, 3) == []


@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(1, 4), st.integers(1, 6))
def test_a_guess_is_what_followed_an_earlier_copy_of_the_suffix(tokens, high, count):
    guess = lookup(tokens, 1, high, count)
    assert len(guess) <= count
    if not guess:  # then no suffix of 1..high tokens occurs earlier
        for size in range(1, min(high, len(tokens) - 1) + 1):
            suffix = tokens[-size:]
            assert all(tokens[b : b + size] != suffix for b in range(len(tokens) - size))
        return
    found = False
    for size in range(1, min(high, len(tokens) - 1) + 1):
        suffix = tokens[-size:]
        for begin in range(len(tokens) - size):
            if tokens[begin : begin + size] == suffix:
                found |= tokens[begin + size : begin + size + len(guess)] == guess
    assert found


# -- the engine: the same tokens, fewer forwards -----------------------------------------


def _tokens(outputs) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


def _top_logprobs(outputs) -> list[list[float]]:
    return [
        [
            max(entry.values(), key=lambda lp: lp.logprob).logprob
            for entry in output.outputs[0].logprobs
        ]
        for output in outputs
    ]


@pytest.fixture(scope="module")
def drafted(short_gguf):
    """Speculation by the cut model as stored (Q4_1, resident) for its float32 self."""
    return {"model": str(short_gguf), "num_speculative_tokens": 4}


@pytest.fixture(scope="module", params=list(SETTINGS))
def llms(request, short_path, tmp_path_factory, drafted):
    """The float32 default model with n-gram lookup and with the stored model drafting,
    offloaded alike (without speculation, offloaded or not, it answers bit for bit as
    resident: tests/llm/test_llm.py; `plain` is that answer)."""
    setting = dict(SETTINGS[request.param])
    if "cpu_memory_gb" in setting:
        setting["offload_folder"] = str(tmp_path_factory.mktemp("disk"))
    made = [
        LLM(short_path, dtype="float32", **setting, **more)
        for more in ({"speculative_config": NGRAM}, {"speculative_config": drafted})
    ]
    yield request.param, *made
    for llm in made:
        llm.close()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_tokens_equal_the_model_without_speculation_alone_and_batched(plain, llms, method):
    setting, *specs = llms
    spec = specs[method == "draft_model"]
    expected = plain.generate(PROMPTS, GREEDY, alone=True)
    spec.generate(PROMPTS[2], SamplingParams(max_tokens=1), use_tqdm=False)  # (KV offload's probe)
    before = spec.transfer_stats()
    alone = [spec.generate(prompt, GREEDY, use_tqdm=False)[0] for prompt in PROMPTS]
    middle = spec.transfer_stats()
    eight = (PROMPTS * 3)[:8]  # (a batch of 8)
    together = spec.generate(eight, GREEDY, use_tqdm=False)
    assert _tokens(alone) == _tokens(expected)
    assert _tokens(together) == _tokens((expected * 3)[:8])
    for got, want in ((alone, expected), (together, (expected * 3)[:8])):
        # (a verify forward's products round otherwise: close, not equal)
        for mine, theirs in zip(_top_logprobs(got), _top_logprobs(want), strict=True):
            assert mine == pytest.approx(theirs, abs=1e-4)
    moved = middle - before
    tokens = sum(map(len, _tokens(alone)))
    assert moved.num_spec_verifies > 0 and moved.num_spec_accepted_tokens > 0
    assert moved.num_spec_accepted_tokens <= moved.num_spec_draft_tokens
    assert moved.num_spec_verifies <= moved.num_spec_drafts
    if method == "draft_model":  # (the stored model agrees with its float32 self mostly)
        assert moved.num_spec_accepted_tokens > moved.num_spec_draft_tokens / 2
    # Every token past each prompt's first: from a decode step or a verify forward, fewer
    # forwards than tokens by the guesses kept.
    decoded = tokens - len(PROMPTS)
    assert moved.num_forwards == len(PROMPTS) + decoded - moved.num_spec_accepted_tokens
    if setting in ("prefetch", "disk"):  # (bytes really moved, per forward)
        assert moved.weight_copied_bytes + moved.disk_read_bytes > 0
    if setting == "kv offload":
        assert moved.kv_moved_bytes > 0


def test_seeded_sampling_draws_the_tokens_decoding_alone_draws(short_path, plain):
    """A guess is kept where the row's own generator, drawing from the model's
    distribution, picks it: the same draws in the same order as without speculation."""
    spec = LLM(short_path, dtype="float32", speculative_config=NGRAM)
    expected = plain.generate(PROMPTS, SAMPLED)
    got = spec.generate(PROMPTS, SAMPLED, use_tqdm=False)
    assert _tokens(got) == _tokens(expected)
    moved = spec.transfer_stats()
    assert moved.num_spec_accepted_tokens > 0  # (the repeated text is guessed and drawn)


def test_a_proposer_that_is_always_wrong_changes_nothing(short_path, plain, monkeypatch):
    """Every guess wrong: the tokens are still the model's own; and where guessing is
    left to pay its way (`Pace`), it is soon left off (plain steps win here)."""

    def wrong(self, rows, counts):
        return [
            [(row.input_token + 1 + i) % 1000 for i in range(count)]
            for row, count in zip(rows, counts, strict=True)
        ]

    expected = plain.generate(PROMPTS, GREEDY)
    monkeypatch.setattr(speculative.NgramProposer, "propose", wrong)
    paced = LLM(short_path, dtype="float32", speculative_config=NGRAM)
    got = paced.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _tokens(got) == _tokens(expected)
    trials = paced.transfer_stats().num_spec_verifies
    assert 0 < trials <= 2 * speculative.Pace.TRIAL  # (its first trial; the next at turn 64)
    monkeypatch.setattr(speculative.Pace, "guesses", lambda self: max(self.depths))
    spec = LLM(short_path, dtype="float32", speculative_config=NGRAM)
    got = spec.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _tokens(got) == _tokens(expected)
    moved = spec.transfer_stats()
    assert moved.num_spec_draft_tokens > 50 and moved.num_spec_accepted_tokens <= 2


def _modes(pace, turns: int, rates) -> list[bool]:
    modes = []
    for turn in range(turns):
        depth = pace.guesses()
        modes.append(depth > 0)
        pace.record(depth, rates(turn, depth > 0), 0.1)
    return modes


def test_the_pace_keeps_the_faster_mode_and_tries_the_other_less_often():
    pace = speculative.Pace((4,))
    trial = pace.TRIAL
    modes = _modes(pace, 300, lambda turn, mode: 4 if mode else 1)  # guessing 4x as fast
    assert modes[: 2 * trial] == [True] * trial + [False] * trial  # both measured first
    plain = [turn for turn, mode in enumerate(modes) if not mode]
    # then plain is tried again after 64 turns, then after 128 (each trial confirming)
    assert plain[trial:] == [*range(68, 68 + trial), *range(197, 197 + trial)]
    modes = _modes(speculative.Pace((4,)), 300, lambda turn, mode: 1 if mode else 3)
    assert sum(modes) == 3 * trial  # measured first, then tried twice: plain wins

    # Where the faster mode changes, the next trial finds it, and the trials come sooner.
    def rates(turn, mode):
        return (4 if mode else 1) if turn < 100 else (1 if mode else 4)

    modes = _modes(speculative.Pace((4,)), 600, rates)
    assert all(modes[100:197]) and not any(modes[197:201])  # (the trial at 197 switches)
    tried = [turn for turn in range(201, 600) if modes[turn]]
    assert tried == [*range(258, 262), *range(387, 391)]


def test_left_to_itself_the_pace_measures_each_depth_then_keeps_the_fastest():
    pace = speculative.Pace(speculative.AUTO_DEPTHS)
    trial, depths = pace.TRIAL, pace.depths
    assert depths == (1, 2, 4, 8, 16, 0)  # (plain steps measured last)
    # tokens/s by depth: 4 guesses pay most here (deeper ones cost more than they keep)
    speed = {0: 1.0, 1: 1.5, 2: 2.0, 4: 3.0, 8: 2.5, 16: 1.2}
    chosen = []
    for _ in range(1000):
        depth = pace.guesses()
        chosen.append(depth)
        pace.record(depth, int(10 * speed[depth]), 1.0)
    assert chosen[: trial * len(depths)] == [d for d in depths for _ in range(trial)]
    after = chosen[trial * len(depths) :]
    assert after.count(4) > 0.95 * len(after)
    tried = [d for d in after if d != 4]  # each other depth tried again, in turn
    assert tried == [d for d in (1, 2, 8, 16, 0) for _ in range(trial)][: len(tried)]
    assert len(tried) >= 3 * trial


def test_left_out_k_gives_the_model_s_tokens_and_guesses(short_path, plain):
    spec = LLM(short_path, dtype="float32", speculative_config={"method": "ngram"})
    assert _tokens(spec.generate(PROMPTS, GREEDY, use_tqdm=False)) == _tokens(
        plain.generate(PROMPTS, GREEDY)
    )
    assert spec.transfer_stats().num_spec_accepted_tokens > 0


def test_max_tokens_stop_strings_and_streaming_hold(short_path, plain):
    spec = LLM(short_path, dtype="float32", speculative_config=NGRAM)
    prompt = PROMPTS[0]
    [free] = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=40))
    late = _first_seen_late(free.outputs[0].text)  # (a stop past guesses kept)
    for params in (
        SamplingParams(temperature=0, max_tokens=7),
        SamplingParams(temperature=0, max_tokens=40, stop=[late]),
        SamplingParams(temperature=0, max_tokens=40, stop=[late], include_stop_str_in_output=True),
    ):
        [mine] = spec.generate(prompt, params, use_tqdm=False)
        [theirs] = plain.generate(prompt, params)
        assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert mine.outputs[0].text == theirs.outputs[0].text
        assert mine.outputs[0].finish_reason == theirs.outputs[0].finish_reason
        assert theirs.outputs[0].finish_reason == ("length" if params.stop is None else "stop")
    assert mine.outputs[0].text.endswith(late) and len(mine.outputs[0].token_ids) < 40
    streamed = list(spec.stream(prompt, GREEDY))
    [whole] = plain.generate(prompt, GREEDY)
    assert streamed[-1].finished and streamed[-1].outputs[0].token_ids == whole.outputs[0].token_ids
    texts = [item.outputs[0].text for item in streamed]
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(texts))
    assert spec.transfer_stats().num_spec_accepted_tokens > 0


def _first_seen_late(text: str) -> str:
    """A piece of `text` that first occurs in its second half."""
    for start in range(len(text) // 2, len(text)):
        for end in range(start + 1, min(start + 8, len(text)) + 1):
            if text[start:end].strip() and text.find(text[start:end]) == start:
                return text[start:end]
    raise AssertionError(f"no piece of {text!r} first occurs in its second half")


def test_rows_that_finish_at_other_steps_keep_the_drafts_rows_in_step(short_path, plain, drafted):
    """Rows leave the batch at other steps (the engine packs the rest, moving rows); the
    draft's rows follow them (moved, or fed again from the start): the same tokens as
    without, and the guesses still mostly kept (a draft row holding another sequence's
    keys would guess wrong: the tokens would still be right, but few guesses kept)."""
    spec = LLM(short_path, dtype="float32", speculative_config=drafted)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 24, 9, 16)]
    prompts = [*PROMPTS, "Tell me about the moon."]
    expected = plain.generate(prompts, params)
    assert _tokens(spec.generate(prompts, params, use_tqdm=False)) == _tokens(expected)
    moved = spec.transfer_stats()
    assert moved.num_spec_accepted_tokens > 0.8 * moved.num_spec_draft_tokens  # (0.95 here)


def test_a_draft_with_another_tokenizer_is_refused_by_name(short_path, tmp_path):
    from http_server import chat_checkpoint

    other = chat_checkpoint(tmp_path / "other")
    config = {"model": str(other), "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="has another tokenizer") as caught:
        LLM(short_path, dtype="float32", speculative_config=config)
    assert str(other) in str(caught.value) and "\n" not in str(caught.value)


def test_the_server_answers_as_without_it_and_counts_in_metrics(short_path, monkeypatch):
    """`offload serve`'s app with n-gram speculation, 4 openai clients at once: the
    answers of the app without it; vLLM's spec_decode counters in /metrics."""
    # (always guessing: left to pay its way, guessing stopped early in some runs)
    monkeypatch.setattr(speculative.Pace, "guesses", lambda self: max(self.depths))
    from concurrent.futures import ThreadPoolExecutor

    from http_server import InProcess, http

    questions = [PROMPTS[0], PROMPTS[1], "Say 'yes yes yes yes yes yes'.", "Name three colors."]

    def answers(llm) -> tuple[list[str], str]:
        app = InProcess(llm)
        try:
            client = app.client()

            def ask(question):
                reply = client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": question}],
                    max_tokens=24, temperature=0,
                )  # fmt: skip
                return reply.choices[0].message.content

            with ThreadPoolExecutor(4) as pool:
                texts = list(pool.map(ask, questions))
            return texts, http(app.url + "/metrics")[1]
        finally:
            app.stop()

    # (rows of a server's length: its app's closures outlive the test, holding its rows'
    # address space, which past the RAM made a later fork in the worker refused)
    small = dict(dtype="float32", max_num_seqs=8, max_model_len=1024)
    plain, _ = answers(LLM(short_path, **small))
    texts, metrics = answers(LLM(short_path, speculative_config=NGRAM, **small))
    assert texts == plain
    counts = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vllm:spec_decode_")
    }
    assert (
        counts["vllm:spec_decode_num_draft_tokens_total"]
        >= counts["vllm:spec_decode_num_accepted_tokens_total"]
        > 0
    )
    assert counts["vllm:spec_decode_num_drafts_total"] > 0


def test_a_random_tiny_draft_is_almost_never_kept_and_changes_nothing(
    short_path, plain, tmp_path, monkeypatch
):
    """A draft model of random weights with the model's own tokenizer: its guesses are
    almost all refused, and the tokens are still the model's own."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (short_path / name).exists():
            shutil.copy(short_path / name, tmp_path / name)
    monkeypatch.setattr(
        speculative.Pace, "guesses", lambda self: max(self.depths)
    )  # (always guess)
    spec = LLM(
        short_path, dtype="float32",
        speculative_config={"model": str(tmp_path), "num_speculative_tokens": 3},
    )  # fmt: skip
    assert _tokens(spec.generate(PROMPTS, GREEDY, use_tqdm=False)) == _tokens(
        plain.generate(PROMPTS, GREEDY)
    )
    moved = spec.transfer_stats()
    assert moved.num_spec_draft_tokens > 50
    assert moved.num_spec_accepted_tokens < 0.1 * moved.num_spec_draft_tokens


def test_the_stored_model_s_kept_tokens_carry_the_decode_steps_bits(short_gguf, monkeypatch):
    """The default model as stored, one prompt at a time: every token and every logprob
    bit for bit those of decoding without speculation (each verify position's attention
    and q8 products as a lone row's decode step computes them: `verify_attention`)."""
    monkeypatch.setattr(
        speculative.Pace, "guesses", lambda self: max(self.depths)
    )  # (always guess)
    plain, spec = LLM(short_gguf), LLM(short_gguf, speculative_config=NGRAM)
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=3)
    for prompt in (PROMPTS[0], PROMPTS[1]):
        [mine] = spec.generate(prompt, params, use_tqdm=False)
        [theirs] = plain.generate(prompt, params, use_tqdm=False)
        assert _answers(mine) == _answers(theirs)
    assert spec.transfer_stats().num_spec_accepted_tokens > 10


def _answers(output) -> tuple:
    completion = output.outputs[0]
    return completion.token_ids, [
        {token: lp.logprob for token, lp in entry.items()} for entry in completion.logprobs
    ]
