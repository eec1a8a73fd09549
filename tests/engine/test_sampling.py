import dataclasses
import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from junk import JUNK

from offload import ConfigError, ModelError, OffloadError
from offload.engine import sampling
from offload.engine.logprobs import prompt_logprobs, token_logprobs
from offload.engine.sampling import (
    SamplingParams,
    TokenCounts,
    adjust_logits,
    bad_words_token_ids,
    banned_tokens,
    filter_logits,
    find_stop,
    make_generator,
    sample,
)


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.max_tokens, p.min_tokens, p.ignore_eos, p.skip_special_tokens) == (16, 0, False, True)
    assert p.stop_strings == () and p.stop_token_ids == [] and not p.include_stop_str_in_output
    penalties = (p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
    assert penalties == (0.0, 0.0, 1.0) and not p.has_penalties
    assert (p.logit_bias, p.allowed_token_ids, p.logprobs, p.prompt_logprobs) == (None,) * 4


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"temperature": -0.1}, "temperature must be in [0.0, 2.0]"),
        ({"top_p": 0.0}, "top_p must be in (0.0, 1.0]"),
        ({"top_p": 1.5}, "top_p must be in (0.0, 1.0]"),
        ({"top_k": -2}, "top_k must be an integer >= -1"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"min_p": 2}, "min_p must be in [0.0, 1.0]"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens must be an integer in [0, 4]"),
        ({"n": 0}, "n must be an integer in [1, 16384]"),
        ({"stop": [""]}, "stop must be a non-empty string"),
        ({"stop": 3}, "stop must be a non-empty string"),
        ({"stop_token_ids": [-1]}, "stop_token_ids[] must be an integer >= 0"),
        ({"temperature": float("nan")}, "temperature must be a number"),
        ({"seed": "7"}, "seed must be an integer"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2.0, 2.0]"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2.0, 2.0]"),
        ({"repetition_penalty": 0}, "repetition_penalty must be in (0.0, inf)"),
        ({"repetition_penalty": "1.2"}, "repetition_penalty must be a number"),
        ({"logit_bias": [1, 2]}, "logit_bias must be a dict"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {1: "up"}}, "logit_bias[] must be a number"),
        ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
        ({"allowed_token_ids": [3, -1]}, "allowed_token_ids[] must be an integer >= 0"),
        ({"logprobs": -2}, "logprobs must be an integer >= -1"),
        ({"prompt_logprobs": 1.5}, "prompt_logprobs must be an integer >= -1"),
        ({"bad_words": "Paris"}, "bad_words must be a list of non-blank strings"),
        ({"bad_words": ["ok", " "]}, "bad_words must be a list of non-blank strings"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be an integer >= 1 or -1"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be an integer >= 1 or -1"),
        ({"best_of": 3}, "best_of=3 is not supported"),
        ({"n": 2, "best_of": 2}, "best_of=2 is not supported"),
    ],
)
def test_bad_values_are_one_line_errors(kwargs, needle):
    with pytest.raises(ConfigError) as info:
        SamplingParams(**kwargs)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_greedy_switches_the_filters_off():
    p = SamplingParams(temperature=0, top_p=0.5, top_k=3, min_p=0.2)
    assert p.is_greedy and (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(stop="###").stop_strings == ("###",)


def _logits(*probs):
    return torch.log(torch.tensor(probs))


@pytest.mark.parametrize(
    ("kwargs", "kept"),
    [
        ({"top_k": 2}, [0, 1]),
        ({"top_k": -1}, [0, 1, 2, 3]),
        ({"top_k": 10}, [0, 1, 2, 3]),
        ({"top_p": 0.4}, [0]),  # the top token alone already reaches 0.4
        ({"top_p": 0.5}, [0]),
        ({"top_p": 0.6}, [0, 1]),
        ({"top_p": 0.95}, [0, 1, 2]),  # as vLLM: mass <= 1 - top_p is cut
        ({"top_p": 0.99}, [0, 1, 2, 3]),
        ({"min_p": 0.5}, [0, 1]),  # tokens with at least half the top probability
        ({"top_k": 3, "top_p": 0.85}, [0, 1, 2]),
    ],
)
def test_filters_keep_the_expected_tokens(kwargs, kept):
    logits = _logits(0.5, 0.3, 0.15, 0.05)
    filtered = filter_logits(logits, SamplingParams(**kwargs))
    assert torch.isfinite(filtered).nonzero().flatten().tolist() == kept


def test_min_p_cuts_before_top_p_measures_the_mass():
    # min_p=0.2 drops the 0.05 token; top_p then measures the remaining mass (vLLM's
    # order): 0.5/0.95 + 0.3/0.95 = 0.84 >= 0.83, so 0.15 goes too.
    kept = filter_logits(_logits(0.5, 0.3, 0.15, 0.05), SamplingParams(min_p=0.2, top_p=0.83))
    assert torch.isfinite(kept).nonzero().flatten().tolist() == [0, 1]


def test_logit_bias_keys_may_be_strings_and_biases_are_clamped():
    p = SamplingParams(logit_bias={"5": 300, 7: -0.5, 9: -1e9})
    assert p.logit_bias == {5: 100.0, 7: -0.5, 9: -100.0}
    named = SamplingParams(stop_token_ids=[3], allowed_token_ids=[4]).token_ids_named()
    assert named == {"stop_token_ids": [3], "logit_bias": [], "allowed_token_ids": [4]}


def _counts(prompt, generated, vocab=6):
    counts = TokenCounts(prompt, vocab, torch.device("cpu"))
    for token in generated:
        counts.add(token)
    return counts


def test_penalties_follow_vllms_formulas():
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 4.0, 0.5])
    counts = _counts(prompt=[0, 1], generated=[2, 3, 2])
    got = adjust_logits(
        logits,
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        counts,
    )
    # tokens 0, 1: prompt only (repetition: divide positive, multiply negative); 2: twice
    # generated; 3: once; 4, 5: never seen, unchanged.
    expected = torch.tensor([1.0, -4.0, 0.5 - 1.0 - 0.25, -2.0 - 0.5 - 0.25, 4.0, 0.5])
    assert torch.equal(got, expected)
    # Presence and frequency read only the output, never the prompt.
    only_output = adjust_logits(logits, SamplingParams(presence_penalty=1.0), counts)
    assert torch.equal(only_output, logits - torch.tensor([0.0, 0, 1, 1, 0, 0]))


def test_repetition_penalty_is_bitwise_transformers_processor():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    seen = torch.randint(0, 500, (1, 40))  # [1, prompt + output]
    logits = torch.randn(1, 500)
    expected = RepetitionPenaltyLogitsProcessor(1.3)(seen, logits.clone())
    counts = _counts(seen[0, :25].tolist(), seen[0, 25:].tolist(), vocab=500)
    got = adjust_logits(logits[0], SamplingParams(repetition_penalty=1.3), counts)
    assert torch.equal(got, expected[0])


def test_allowed_tokens_and_logit_bias_steer_greedy_picks():
    logits = torch.tensor([[5.0, 1.0, 2.0, 3.0]] * 2)
    params = [
        SamplingParams(temperature=0, allowed_token_ids=[1, 2]),
        SamplingParams(temperature=0, logit_bias={1: 10.0}),
    ]
    assert sample(logits, params, [None, None]).tolist() == [2, 1]
    # An untouched request keeps its logits as they are: no copy, no float32 cast.
    plain = logits[0].half()
    assert adjust_logits(plain, SamplingParams(), None) is plain


def test_a_penalty_changes_greedy_picks_per_row():
    logits = torch.tensor([[3.0, 2.9, 0.0]] * 2)
    params = [SamplingParams(temperature=0, presence_penalty=0.2)] * 2
    counts = [_counts([2], [0], vocab=3), _counts([2], [1], vocab=3)]
    # Each row is penalised for its own output only.
    assert sample(logits, params, [None, None], counts).tolist() == [1, 0]


def test_token_logprobs_put_the_chosen_token_first_with_its_rank():
    logprobs = torch.log_softmax(torch.tensor([1.0, 3.0, 2.0, 0.0]), dim=-1)
    entries = token_logprobs(logprobs, 3, 2, str)
    assert list(entries) == [3, 1, 2]
    assert [e.rank for e in entries.values()] == [4, 1, 2]
    assert entries[3].logprob == logprobs[3].item() and entries[1].decoded_token == "1"
    assert list(token_logprobs(logprobs, 1, 2, str)) == [1, 2]  # chosen inside the top: k
    assert list(token_logprobs(logprobs, 2, 0, str)) == [2]
    assert len(token_logprobs(logprobs, 0, -1, str)) == 4
    prompt = prompt_logprobs(torch.randn(3, 4), [2, 0, 1], 1, str)
    assert prompt[0] is None and [next(iter(e)) for e in prompt[1:]] == [0, 1]


def test_greedy_rows_take_the_argmax_of_the_raw_logits():
    torch.manual_seed(0)
    logits = torch.randn(5, 100)
    params = [SamplingParams(temperature=0)] * 5
    assert torch.equal(sample(logits, params, [None] * 5), logits.argmax(dim=-1))


def test_seeded_requests_reproduce_alone_or_in_any_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0)]

    def alone():
        generator = make_generator(seeded, logits.device)
        return [sample(logits[:1], [seeded], [generator])[0].item() for _ in range(20)]

    first = alone()
    assert alone() == first
    assert len(set(first)) > 1  # really sampled, not greedy
    generators = [make_generator(seeded, logits.device), None, None]
    in_batch = [sample(logits, [seeded, *others], generators)[0].item() for _ in range(20)]
    assert in_batch == first


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(probs).repeat(4000, 1)
    params = SamplingParams(temperature=1.0, seed=7)
    generator = make_generator(params, logits.device)
    tokens = sample(logits, [params] * 4000, [generator] * 4000)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)
    hot = sample(
        torch.log(probs).repeat(2000, 1),
        [SamplingParams(temperature=0.2, seed=7)] * 2000,
        [make_generator(params, logits.device)] * 2000,
    )
    assert (hot == 0).float().mean() > 0.9  # a low temperature sharpens toward the top token


@pytest.mark.parametrize(
    ("text", "stops", "include", "expected"),
    [
        ("Paris. Next", ["."], False, ("Paris", ".")),
        ("Paris. Next", ["."], True, ("Paris.", ".")),
        ("abcXYdefXY", ["XY", "def"], False, ("abc", "XY")),
        ("abc def XY", ["XY", "def"], False, ("abc ", "def")),
        (" Paris", ["ris", "Pa"], True, (" Pa", "Pa")),  # the stop that cut, not the first listed
        ("no stop here", ["###"], False, None),
        ("", ["x"], False, None),
    ],
)
def test_find_stop(text, stops, include, expected):
    assert find_stop(text, stops, include) == expected


@given(st.text(max_size=30), st.lists(st.text(min_size=1, max_size=3), max_size=3))
def test_find_stop_properties(text, stops):
    found = find_stop(text, stops)
    if found is None:
        assert not any(stop in text for stop in stops)
    else:
        cut, stop = found
        assert text.startswith(cut) and not any(s in cut for s in stops)
        assert stop in stops and text[len(cut) :].startswith(stop)
    assert math.isfinite(len(text))


def test_bad_words_are_found_alone_and_after_a_space_as_vllm_does():
    vocab = {"cat": [1], " cat": [2], "big cat": [3, 1], " big cat": [4, 1], "a b": [5, 6]}

    def encode(text):
        return vocab.get(text, [9, 9, 9])

    assert bad_words_token_ids(["cat"], encode) == [[1], [2]]
    assert bad_words_token_ids([" big cat"], encode) == [[3, 1], [4, 1]]
    # " a b" encodes to another length: only the word alone counts.
    assert bad_words_token_ids(["a b"], encode) == [[5, 6]]


def test_a_bad_word_loses_its_last_token_only_after_the_others():
    bad = [[7], [3, 4, 5]]
    assert banned_tokens(bad, []) == [7]
    assert banned_tokens(bad, [1, 3]) == [7]
    assert banned_tokens(bad, [1, 3, 4]) == [7, 5]
    assert banned_tokens(bad, [3, 4, 1]) == [7]
    assert banned_tokens([[3, 4, 5]], [4]) == []  # shorter than the head: no wrap-around


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"temperature": float("inf")}, "temperature must be in [0.0, 2.0]"),
        ({"temperature": 10**400}, "temperature must be in [0.0, 2.0], got 1000"),
        ({"temperature": 2.5}, "temperature must be in [0.0, 2.0]"),
        ({"top_p": float("nan")}, "top_p must be a number"),
        ({"top_k": 1.5}, "top_k must be an integer"),
        ({"min_p": float("nan")}, "min_p must be a number"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias[] must be a number"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be in (0.0, inf)"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty must be a number"),
        ({"presence_penalty": float("inf")}, "presence_penalty must be in [-2.0, 2.0]"),
        ({"max_tokens": 1.5}, "max_tokens must be an integer"),
        ({"max_tokens": "a"}, "max_tokens must be an integer"),
        ({"n": 10**6}, "n must be an integer in [1, 16384]"),
        ({"seed": "a"}, "seed must be an integer"),
        ({"seed": 2**64}, "seed must be an integer"),
        ({"stop": [5]}, "stop must be a non-empty string"),
        ({"stop": 0}, "stop must be a non-empty string"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids"),
        ({"stop_token_ids": {1: 2}}, "stop_token_ids must be a list of token ids"),
        ({"ignore_eos": "x"}, "ignore_eos must be True or False"),
        ({"skip_special_tokens": 1}, "skip_special_tokens must be True or False"),
        ({"include_stop_str_in_output": None}, "include_stop_str_in_output must be True"),
        ({"logprobs": -2}, "logprobs must be an integer >= -1"),
    ],
)
def test_junk_values_are_one_line_errors_naming_the_field(kwargs, needle):
    with pytest.raises(ConfigError) as info:
        SamplingParams(**kwargs)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_a_huge_or_infinite_logit_bias_is_clamped_as_vllm_does():
    bias = SamplingParams(logit_bias={1: float("inf"), 2: -(10**400), 3: 1e400}).logit_bias
    assert bias == {1: 100.0, 2: -100.0, 3: 100.0}


@pytest.mark.parametrize("tiny", [1e-300, 1e-45, 1e-6, 0.005])
def test_a_tiny_temperature_is_raised_to_vllms_floor_and_samples_finitely(tiny):
    with pytest.warns(UserWarning, match="raised to 0.01"):
        params = SamplingParams(temperature=tiny, seed=3)
    assert params.temperature == 0.01 and not params.is_greedy
    logits = torch.tensor([[30.0, 29.99, -50.0, 0.0]])
    token = sample(logits, [params], [make_generator(params, logits.device)])
    assert token.item() in (0, 1)


def _one_row(params, logits, counts=None):
    return sample(logits[None], [params], [make_generator(params, logits.device)], [counts], [4])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_no_token_left_to_pick_is_an_error_naming_the_settings(temperature):
    """allowed_token_ids whose every id is banned: torch.multinomial's RuntimeError
    when sampling, a silent token 0 when greedy; now one line naming the settings."""
    params = SamplingParams(temperature=temperature, allowed_token_ids=[2], bad_words=["x"])
    logits = torch.tensor([1.0, 2.0, -float("inf"), 0.5])  # token 2 banned (a bad word)
    with pytest.raises(
        ConfigError, match="no token is left to pick for prompt 4: allowed_token_ids"
    ):
        _one_row(params, logits)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_penalty_that_overflows_the_logits_is_an_error_naming_it(temperature):
    params = SamplingParams(temperature=temperature, repetition_penalty=1e-40)
    counts = TokenCounts([0, 1], 4, torch.device("cpu"))
    with pytest.raises(
        ConfigError, match=r"repetition_penalty=1e-40 made the logits of prompt 4 inf or nan"
    ):
        _one_row(params, torch.tensor([5.0, 4.0, 1.0, 0.0]), counts)


def test_nan_logits_from_the_model_are_a_model_error():
    with pytest.raises(ModelError, match="model's logits for prompt 4 hold nan or inf"):
        _one_row(SamplingParams(temperature=1.0), torch.tensor([1.0, float("nan"), 0.0, 0.0]))


_FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if f.init]


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from(_FIELDS), value=JUNK)
def test_junk_in_any_field_builds_or_raises_an_offload_error(field, value):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            SamplingParams(**{field: value})
    except OffloadError as error:
        assert "\n" not in str(error)


def test_a_mixed_batch_picks_what_each_row_picks_alone():
    """Plain greedy rows go in one pass; penalized greedy and sampled rows one by one:
    every row's token is the one it gets alone, ties going to the first maximum."""
    torch.manual_seed(0)
    logits = torch.randn(6, 64)
    logits[2, 10] = logits[2, 20] = logits[2].max() + 1  # a tie: the first one wins
    counts = TokenCounts([3, 4], 64, logits.device)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, presence_penalty=2.0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, seed=5),
        SamplingParams(temperature=0, logit_bias={7: 50.0}),
        SamplingParams(temperature=0),
    ]
    row_counts = [None, counts, None, None, None, None]

    def alone(row):
        generator = make_generator(params[row], logits.device)
        return sample(logits[row : row + 1].clone(), [params[row]], [generator],
                      [row_counts[row]])[0].item()  # fmt: skip

    generators = [make_generator(p, logits.device) for p in params]
    together = sample(logits.clone(), params, generators, row_counts).tolist()
    assert together == [alone(row) for row in range(6)]
    assert together[2] == 10 and together[4] == 7


def test_a_plain_greedy_row_of_nan_is_named_among_good_rows():
    logits = torch.randn(4, 16)
    logits[2, 5] = float("nan")
    params = [SamplingParams(temperature=0)] * 3 + [SamplingParams(temperature=1.0)]
    with pytest.raises(ModelError, match="model's logits for prompt 12 hold nan or inf"):
        sample(logits, params, [None] * 4, prompts=[10, 11, 12, 13])


@settings(max_examples=300, deadline=None)
@given(
    marks=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 7), st.sampled_from(["nan", "inf", "-inf"])),
        max_size=12,
    ),
    all_excluded=st.sets(st.integers(0, 3)),
)
def test_greedy_rows_flag_what_nothing_can_be_picked_from_as_the_full_check_does(
    marks, all_excluded
):
    """The plain greedy rows' one pass (`_greedy`: the picked logit's finiteness) flags
    exactly the rows `_unusable` flags, nan, +inf and every logit -inf alike."""
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(len(marks)))
    for row in all_excluded:
        logits[row] = -math.inf
    for row, column, value in marks:
        logits[row, column] = float(value)
    tokens, unusable = sampling._greedy(logits)
    assert torch.equal(unusable, sampling._unusable(logits))
    assert torch.equal(tokens, torch.argmax(logits, dim=-1))


def test_a_batch_of_plain_greedy_rows_names_its_nan_row():
    logits = torch.randn(3, 16)
    logits[1, 5] = float("nan")
    with pytest.raises(ModelError, match="model's logits for prompt 7 hold nan or inf"):
        sample(logits, [SamplingParams(temperature=0)] * 3, [None] * 3, prompts=[6, 7, 8])
