"""Speculative decoding keeps the model's distribution when it samples: over 20k draws of
a small-vocabulary model, the tokens drawn with a draft's guesses kept and without
speculation agree (a chi-square test of homogeneity)."""

import collections

import pytest
import torch

from offload import SamplingParams
from offload.engine import speculative
from offload.llm.llm import LLM

VOCAB = 8
DRAWS = 20_480  # (80 prompts of 256 samples)
PROMPT = {"prompt_token_ids": [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random Llama of 8 tokens with its own word-level tokenizer; its head scaled so
    that its next-token distributions are far from uniform but rarely certain."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=VOCAB - 1, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    model.save_pretrained(path)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=words, bos_token="t0", eos_token=f"t{VOCAB - 1}", unk_token="t1"
    ).save_pretrained(path)
    return path


def _draws(llm: LLM, temperature: float = 1.0) -> collections.Counter:
    """The second and third tokens of DRAWS sampled answers (the first comes from the
    prompt's forward, where nothing is guessed)."""
    params = SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True, n=256)
    outputs = llm.generate([PROMPT] * (DRAWS // 256), params, use_tqdm=False)
    return collections.Counter(
        tuple(completion.token_ids[1:]) for output in outputs for completion in output.outputs
    )


def _p_value(first: collections.Counter, second: collections.Counter) -> float:
    """The chi-square test of homogeneity of two samples' counts (cells expected below 5
    in either merged into one), its p-value."""
    cells = sorted(set(first) | set(second))
    total_a, total_b = sum(first.values()), sum(second.values())
    share_a = total_a / (total_a + total_b)
    merged, rest = [], [0, 0]
    for cell in cells:
        a, b = first[cell], second[cell]
        if min((a + b) * share_a, (a + b) * (1 - share_a)) < 5:
            rest[0], rest[1] = rest[0] + a, rest[1] + b
        else:
            merged.append((a, b))
    if sum(rest):
        merged.append(tuple(rest))
    statistic = 0.0
    for a, b in merged:
        expected_a, expected_b = (a + b) * share_a, (a + b) * (1 - share_a)
        statistic += (a - expected_a) ** 2 / expected_a + (b - expected_b) ** 2 / expected_b
    freedom = len(merged) - 1
    return float(torch.special.gammaincc(torch.tensor(freedom / 2), torch.tensor(statistic / 2)))


def test_sampled_tokens_keep_the_model_s_distribution_with_guesses_kept(tiny, monkeypatch):
    monkeypatch.setattr(
        speculative.Pace, "guesses", lambda self: max(self.depths)
    )  # (always guess)
    # (other seeds: independent draws, not the same draws in the same order)
    plain = LLM(str(tiny), dtype="float32", seed=1, max_num_seqs=1024)
    expected = _draws(plain)
    spec = LLM(
        str(tiny), dtype="float32", seed=2, max_num_seqs=1024,
        speculative_config={"model": str(tiny), "num_speculative_tokens": 3},
    )  # fmt: skip
    got = _draws(spec)
    moved = spec.transfer_stats()
    # The draft (the model itself, greedy) is often right: most third tokens are kept guesses.
    assert moved.num_spec_accepted_tokens > DRAWS / 2
    assert len(expected) > 10  # (a distribution, not a certainty)
    assert _p_value(got, expected) > 0.01
    # The test tells a distribution a little off: the model's own at temperature 0.9.
    assert _p_value(_draws(plain, temperature=0.9), expected) < 0.01


def test_seeded_sampled_runs_repeat(tiny):
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, n=8, seed=5)
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    runs = [
        LLM(str(tiny), dtype="float32", speculative_config=config).generate(
            [PROMPT] * 4, params, use_tqdm=False
        )
        for _ in range(2)
    ]
    tokens = [[[c.token_ids for c in o.outputs] for o in run] for run in runs]
    assert tokens[0] == tokens[1]
