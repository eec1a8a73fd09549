"""`SamplingParams(structured_outputs=...)` in `LLM.generate`: choices and regular
expressions on the default model (each output one of its choices, or matching its
expression whole), and on a tiny checkpoint, offloaded answers bit for bit as resident
ones, and plain requests beside structured ones as they are alone."""

import re

import pytest
import zoo

from offload import LLM, SamplingParams, StructuredOutputsParams

pytest.importorskip("xgrammar")

CHOICES = [
    ("Is the sky blue?", ["yes", "no"]),
    ("Pick a color.", ["red", "green", "blue"]),
    ("How many legs has a cat?", ["2", "4", "6", "8"]),
    ("Best pet?", ["cat", "dog", "a goldfish"]),
    ("Rate it.", ["*", "**", "***"]),  # (each a prefix of the next)
    ("Say a word.", ["a", "ab", "abc"]),
    ("The capital of France?", ["Paris", "London", "Rome", "Berlin"]),
    ("Quote it.", ['"quoted"', "plain"]),
    ("Two lines?", ["one\ntwo", "one line"]),
    ("Greet me.", ["héllo", "こんにちは", "hi"]),
    ("Only one answer.", ["the only one"]),
    ("Yes or no?", ["Yes.", "No."]),
    ("A weekday.", ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]),
    ("Sum of 2 and 2?", ["3", "4", "5"]),
    ("A season.", ["spring", "summer", "autumn", "winter"]),
    ("True?", ["true", "false", "null"]),
    ("A path.", ["C:\\temp", "/tmp"]),
    ("Braces.", ["{}", "[]", "()"]),
    ("A planet.", ["Mercury", "Venus", "Earth", "Mars"]),
    ("An emoji.", ["🙂", "🙃"]),
]
REGEXES = [
    ("A phone number:", r"[0-9]{3}-[0-9]{4}"),
    ("A date:", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
    ("A hex color:", r"#[0-9a-f]{6}"),
    ("A name:", r"[A-Z][a-z]{2,8}"),
    ("An email:", r"[a-z]{3,6}@[a-z]{3,6}\.com"),
    ("A boolean:", r"(true|false)"),
    ("A price:", r"\$[0-9]{1,4}\.[0-9]{2}"),
    ("A plate:", r"[A-Z]{2}[0-9]{3}"),
    ("A small number:", r"(0|[1-9][0-9]{0,2})"),
    ("A US phone:", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
    ("A few words:", r"[a-z]{1,8}( [a-z]{1,8}){1,3}"),
    ("Two colors:", r"(red|green|blue), (red|green|blue)"),
    ("A version:", r"v[0-9]\.[0-9]\.[0-9]"),
    ("A byte:", r"[01]{8}"),
    ("A site:", r"https://[a-z]{2,10}\.org"),
    ("A shout:", r"[A-Za-z]{1,10}!"),
    ("A day:", r"(Mon|Tue|Wed)day"),
    ("A time:", r"([01][0-9]|2[0-3]):[0-5][0-9]"),
    ("A signed decimal:", r"-?[0-9]{1,3}\.[0-9]{2}"),
    ("A code:", r"[A-Z]{3}-[0-9]{2}"),
]


@pytest.fixture(scope="module")
def llm():
    with LLM(max_model_len=256, max_num_seqs=24) as made:
        yield made


def _params(number: int, max_tokens: int = 40, **spec) -> SamplingParams:
    """Greedy for even numbers, sampled (seeded) for odd ones; logprobs of 3 tokens."""
    how = {"temperature": 0.8, "seed": number} if number % 2 else {"temperature": 0}
    structured = StructuredOutputsParams(**spec)
    return SamplingParams(max_tokens=max_tokens, logprobs=3, structured_outputs=structured, **how)


def test_each_answer_is_one_of_its_choices(llm):
    params = [_params(n, choice=choices) for n, (_, choices) in enumerate(CHOICES)]
    outputs = llm.generate([prompt for prompt, _ in CHOICES], params, use_tqdm=False)
    for (_, choices), output in zip(CHOICES, outputs, strict=True):
        completion = output.outputs[0]
        assert completion.text in choices and completion.finish_reason == "stop"


def test_each_answer_matches_its_expression_whole(llm):
    params = [_params(n, regex=regex) for n, (_, regex) in enumerate(REGEXES)]
    outputs = llm.generate([prompt for prompt, _ in REGEXES], params, use_tqdm=False)
    for (_, regex), output in zip(REGEXES, outputs, strict=True):
        completion = output.outputs[0]
        assert re.fullmatch(regex, completion.text), (regex, completion.text)
        assert completion.finish_reason == "stop"


# On the tiny checkpoint's word tokenizer ("t3" to "t127", one token each).
TINY_SPECS = [
    {"regex": "(t1[0-9]){2,6}"},
    {"choice": ["t5t6t7", "t9", "t20t21"]},
    {"grammar": 'root ::= "t3" item item? item?\nitem ::= "t4" | "t5" | "t6"'},
    {"regex": "t7(t[3-9]){0,5}"},
]
PROMPTS = [{"prompt_token_ids": ids} for ids in ([3, 4, 5], [9, 10], [30, 31, 32, 33], [7])]


def _tiny_params():
    structured = [_params(n, max_tokens=12, **spec) for n, spec in enumerate(TINY_SPECS)]
    plain = [
        SamplingParams(max_tokens=12, logprobs=3, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, logprobs=3, temperature=0.8, seed=7, ignore_eos=True),
    ]
    return structured, plain


def _answers(outputs):
    return [
        (tuple(c.token_ids), [sorted((t, lp.logprob) for t, lp in e.items()) for e in c.logprobs])
        for output in outputs
        for c in output.outputs
    ]


def test_offloaded_answers_are_residents_bit_for_bit(tmp_path):
    path = zoo.save_attentive_llm(tmp_path)
    structured, plain = _tiny_params()
    prompts, params = PROMPTS + PROMPTS[:2], structured + plain
    with LLM(path, max_model_len=64) as resident:
        expected = _answers(resident.generate(prompts, params, use_tqdm=False))
    flags = {"offload_group_size": 1, "offload_prefetch_step": 2}
    with LLM(path, max_model_len=64, **flags) as offloaded:
        assert _answers(offloaded.generate(prompts, params, use_tqdm=False)) == expected
        assert offloaded.transfer_stats().weight_copied_bytes > 0
    for tokens, _ in expected[:4]:  # (each structured answer ended by its grammar)
        assert tokens[-1] == 2 and len(tokens) < 12


def test_plain_requests_beside_structured_ones_answer_as_alone(tmp_path):
    path = zoo.save_attentive_llm(tmp_path)
    structured, plain = _tiny_params()
    with LLM(path, max_model_len=64, batch_invariant=True) as llm:
        alone = _answers(llm.generate(PROMPTS[:2], plain, use_tqdm=False))
        mixed = llm.generate(PROMPTS[:2] + PROMPTS, plain + structured, use_tqdm=False)
        assert _answers(mixed[:2]) == alone
