import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from offload import ConfigError
from offload.engine.sampling import SamplingParams, filter_logits, find_stop, make_generator, sample


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.max_tokens, p.min_tokens, p.ignore_eos, p.skip_special_tokens) == (16, 0, False, True)
    assert p.stop_strings == () and p.stop_token_ids == [] and not p.include_stop_str_in_output


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"temperature": -0.1}, "temperature must be in [0.0, inf]"),
        ({"top_p": 0.0}, "top_p must be in (0.0, 1.0]"),
        ({"top_p": 1.5}, "top_p must be in (0.0, 1.0]"),
        ({"top_k": -2}, "top_k must be an integer >= -1"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"min_p": 2}, "min_p must be in [0.0, 1.0]"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens must be an integer in [0, 4]"),
        ({"n": 0}, "n must be an integer >= 1"),
        ({"stop": [""]}, "stop must be a non-empty string"),
        ({"stop": 3}, "stop must be a non-empty string"),
        ({"stop_token_ids": [-1]}, "stop_token_ids[] must be an integer >= 0"),
        ({"temperature": float("nan")}, "temperature must be a number"),
        ({"seed": "7"}, "seed must be an integer"),
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
