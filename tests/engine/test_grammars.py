"""Structured outputs at the sampler: the grammar's mask where a row has one (the only
tokens it may pick, the stop token only where its language is complete, logprobs of
the masked logits), and rows without one not touched, bit for bit."""

import ast
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
import zoo
from hypothesis import given, settings
from hypothesis import strategies as st
from junk import JUNK

import offload
from offload import ConfigError, OffloadError, SamplingParams, StructuredOutputsParams
from offload.engine import structured
from offload.engine.grammars import Grammars, apply_bitmask, mask_logits
from offload.engine.logprobs import log_softmax
from offload.engine.request_maker import RequestMaker
from offload.engine.tokens import TokenSteps

xgr = pytest.importorskip("xgrammar")
EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    return zoo._word_tokenizer(zoo.VOCAB)  # one word per token: "t3" to "t127"


def _maker(tokenizer, vocab_size=zoo.VOCAB):
    steps = TokenSteps(tokenizer, [EOS])
    maker = RequestMaker(
        64,
        vocab_size,
        -1,
        torch.device("cpu"),
        steps.encode,
        Grammars(tokenizer, vocab_size, [EOS]),
    )
    return steps, maker


def _params(kind=None, spec=None, **kwargs):
    so = StructuredOutputsParams(**{kind: spec}) if kind else None
    return SamplingParams(max_tokens=40, structured_outputs=so, **kwargs)


def _run(steps, sequences, seed=0, width=zoo.VOCAB):
    """Picks from random logits until every sequence ends; the logits of each step."""
    generator = torch.Generator().manual_seed(seed)
    seen = []
    while any(s.finish_reason is None for s in sequences):
        logits = torch.randn(len(sequences), width, generator=generator) * 3
        seen.append(logits.clone())
        steps.pick(logits, sequences)
    return seen


def test_plain_rows_keep_their_logits_tokens_and_logprobs_bit_for_bit(tokenizer):
    steps, maker = _maker(tokenizer)
    plain = [_params(temperature=0, logprobs=3), _params(temperature=0.8, seed=4, logprobs=3)]
    ruled = [
        _params("regex", "(t1[0-9])+", temperature=0, logprobs=3),
        _params("choice", ["t5t6t7", "t9"], temperature=0.8, seed=1),
    ]
    mixed = [maker.sequences([3, 4], p, i)[0] for i, p in enumerate(plain + ruled)]
    alone = [maker.sequences([3, 4], p, i)[0] for i, p in enumerate(plain)]
    generator = torch.Generator().manual_seed(0)
    for _ in range(6):
        logits = torch.randn(4, zoo.VOCAB, generator=generator) * 3
        before = logits.clone()
        live = [s.finish_reason is None for s in mixed]
        tokens = steps.pick(logits, mixed)
        assert torch.equal(logits[:2], before[:2])  # (the plain rows: not written)
        assert steps.pick(before[:2].clone(), alone).tolist() == tokens[:2].tolist()
        if live[2]:
            assert bool(torch.isneginf(logits[2]).any())  # (the grammar's rows: masked)
    for together, apart in zip(mixed[:2], alone, strict=True):
        assert together.tokens == apart.tokens and together.logprobs == apart.logprobs


@pytest.mark.parametrize(
    ("kind", "spec", "check"),
    [
        ("regex", "t5(t1[0-9]){2,4}", lambda text: re.fullmatch("t5(t1[0-9]){2,4}", text)),
        ("choice", ["t7t8", "t9", "t10t11t12"], lambda text: text in ("t7t8", "t9", "t10t11t12")),
        ("grammar", 'root ::= "t3" ("t4" | "t5")+', lambda text: re.fullmatch("t3(t4|t5)+", text)),
    ],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_sequence_keeps_to_its_grammar_and_ends_with_it(
    tokenizer, kind, spec, check, temperature
):
    steps, maker = _maker(tokenizer)
    params = _params(kind, spec, temperature=temperature, seed=3, n=3, logprobs=0)
    sequences = maker.sequences([3, 4], params, 0)
    assert len({id(s.grammar) for s in sequences}) == 3  # (each of the n its own)
    _run(steps, sequences)
    for sequence in sequences:
        words = tokenizer.convert_ids_to_tokens(sequence.tokens[:-1])
        assert check("".join(words)), words
        assert sequence.tokens[-1] == EOS and sequence.finish_reason == "stop"
        assert sequence.stop_reason is None and EOS not in sequence.tokens[:-1]


def test_the_end_token_only_where_the_language_is_complete(tokenizer):
    _, maker = _maker(tokenizer)
    [sequence] = maker.sequences([3], _params("choice", ["t5", "t5t6"]), 0)
    logits = torch.zeros(1, zoo.VOCAB)
    mask_logits(logits, [sequence.grammar])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [5]  # not EOS yet
    assert sequence.grammar.accept(5)
    logits = torch.zeros(1, zoo.VOCAB)
    mask_logits(logits, [sequence.grammar])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [EOS, 6]


def test_logprobs_are_those_of_the_masked_logits_as_vllms(tokenizer):
    steps, maker = _maker(tokenizer)
    [sequence] = maker.sequences([3], _params("choice", ["t9", "t10"], logprobs=-1), 0)
    logits = torch.randn(1, zoo.VOCAB, generator=torch.Generator().manual_seed(0))
    masked = logits.clone()
    masked[0, [i for i in range(zoo.VOCAB) if i not in (9, 10)]] = -float("inf")
    steps.pick(logits, [sequence])
    expected = log_softmax(masked[0])
    entry = sequence.logprobs[0]
    assert entry[sequence.tokens[0]].logprob == float(expected[sequence.tokens[0]])
    assert sorted(t for t, lp in entry.items() if lp.logprob > -float("inf")) == [9, 10]


def test_a_grammar_that_ends_ends_the_sequence_with_ignore_eos(tokenizer):
    steps, maker = _maker(tokenizer)
    [sequence] = maker.sequences([3], _params("choice", ["t5"], ignore_eos=True, temperature=0), 0)
    _run(steps, [sequence])
    assert sequence.tokens == [5, EOS] and sequence.finish_reason == "stop"


def test_no_token_left_names_structured_outputs(tokenizer):
    steps, maker = _maker(tokenizer)
    params = _params("choice", ["t5"], min_tokens=3, temperature=0)
    [sequence] = maker.sequences([3], params, 0)
    steps.pick(torch.randn(1, zoo.VOCAB), [sequence])
    with pytest.raises(ConfigError, match="structured_outputs, min_tokens"):
        steps.pick(torch.randn(1, zoo.VOCAB), [sequence])


def test_columns_past_the_grammars_vocabulary_are_masked(tokenizer):
    _, maker = _maker(tokenizer)
    [sequence] = maker.sequences([3], _params("json_object", True), 0)
    logits = torch.zeros(2, zoo.VOCAB + 40)  # (a padded lm_head)
    mask_logits(logits, [None, sequence.grammar])
    assert bool(torch.isneginf(logits[1, zoo.VOCAB :]).all()) and not logits[0].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_torch_mask_is_xgrammars_kernel(dtype):
    """The path for logits off the CPU (xgrammar's kernel there needs triton), run here."""
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 4), dtype=torch.int32, generator=generator)
    logits = torch.randn(5, 120, generator=generator).to(dtype)
    ours, theirs = logits.clone(), logits.clone()
    apply_bitmask(ours, bitmask, [0, 2, 3], 120)
    xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=120, indices=[0, 2, 3])
    assert torch.equal(ours, theirs) and torch.equal(ours[[1, 4]], logits[[1, 4]])


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({}, "must set exactly one of json, regex, choice, grammar, json_object; got none"),
        ({"regex": "a", "choice": ["a"]}, "json_object; got regex, choice"),
        ({"json": "{bad"}, "structured_outputs.json is not valid JSON"),
        ({"json": [1]}, "structured_outputs.json must be a JSON schema (an object)"),
        (
            {"json": {"type": "nonsense"}},
            'structured_outputs.json is not valid: Unsupported type "nonsense"',
        ),
        ({"regex": "(["}, "structured_outputs.regex is not valid: Regex parsing error"),
        ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
        ({"grammar": "root ::= "}, "structured_outputs.grammar is not valid: EBNF parser error"),
        ({"choice": "ab"}, "structured_outputs.choice must be a non-empty list of strings"),
        ({"choice": []}, "structured_outputs.choice must be a non-empty list of strings"),
        ({"json_object": 1}, "structured_outputs.json_object must be true"),
        ({"json_object": True, "disable_any_whitespace": "no"}, "disable_any_whitespace must be"),
    ],
)
def test_bad_specs_are_one_line_config_errors(kwargs, needle):
    with pytest.raises(ConfigError) as error:
        StructuredOutputsParams(**kwargs)
    assert needle in str(error.value) and "\n" not in str(error.value)


def test_choices_are_quoted_whatever_they_hold():
    grammar = structured.choice_grammar(['a"b', "c\\\n", "é"])
    assert grammar == 'root ::= "a\\"b" | "c\\\\\\u000a" | "é"'
    xgr.Grammar.from_ebnf(grammar)


def test_sampling_params_take_a_dict_and_vllms_older_name():
    made = SamplingParams(structured_outputs={"regex": "[ab]+"}).structured_outputs
    assert made.kind == "regex" and made.spec == "[ab]+"
    older = SamplingParams(guided_decoding=structured.GuidedDecodingParams(choice=["x"]))
    assert older.structured_outputs.kind == "choice" and older.guided_decoding is None
    with pytest.raises(ConfigError, match="structured_outputs takes json, regex"):
        SamplingParams(structured_outputs={"jsn": {}})


@settings(max_examples=150, deadline=None)
@given(field=st.sampled_from(StructuredOutputsParams.FIELDS), value=JUNK)
def test_junk_in_any_field_builds_or_raises_an_offload_error(field, value):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            StructuredOutputsParams(**{field: value})
    except OffloadError as error:
        assert "\n" not in str(error)


def test_without_xgrammar_a_structured_request_names_the_extra(tokenizer, monkeypatch):
    _, maker = _maker(tokenizer)
    spec = StructuredOutputsParams(regex="t5")
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # (import xgrammar: ImportError)
    message = "structured outputs need the xgrammar package: pip install 'offload[structured]'"
    with pytest.raises(ConfigError) as error:
        StructuredOutputsParams(json={"type": "object"})
    assert str(error.value) == message
    with pytest.raises(ConfigError, match=re.escape(message)):
        maker.sequences([3], SamplingParams(structured_outputs=spec), 0)
    assert maker.sequences([3], SamplingParams(), 0)[0].grammar is None  # (plain: no need)


def test_xgrammar_is_imported_in_one_function_only():
    """`import offload` (and everything a plain request runs) never imports xgrammar: its
    one import is inside `structured.xgrammar()`, which structured requests call."""
    found = []
    for path in Path(offload.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text())
        functions = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)]
        inside = {id(node): f.name for f in functions for node in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            if any(name.split(".")[0] == "xgrammar" for name in names):
                found.append((path.name, inside.get(id(node))))
    assert found == [("structured.py", "xgrammar")]
