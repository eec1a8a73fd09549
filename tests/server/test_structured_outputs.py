"""Structured outputs through `offload serve` and the openai client, on the default model:
`response_format` JSON schemas (every answer parses and validates against its schema,
greedy and sampled), vLLM's `guided_*` and `structured_outputs` fields, and each bad
value a 400 naming its field."""

import concurrent.futures
import json
import sys

import openai
import pytest
from http_server import InProcess

from offload import LLM

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")


def _text(length=8):
    return {"type": "string", "maxLength": length}


def _int(low, high):
    return {"type": "integer", "minimum": low, "maximum": high}


def _number(low, high):
    return {"type": "number", "minimum": low, "maximum": high}


def _array(items, low, high):
    return {"type": "array", "items": items, "minItems": low, "maxItems": high}


def _object(properties, required=None):
    required = list(properties) if required is None else required
    return {"type": "object", "properties": properties, "required": required}


def _enum(*values):
    return {"enum": list(values)}


BOOL, NULL = {"type": "boolean"}, {"type": "null"}
# Nested objects, arrays with minItems/maxItems, enums, bounded integers and numbers,
# required and optional fields, booleans, nullable values (strings bounded: a small model
# may ramble inside one).
SCHEMAS = [
    _object({"name": _text(), "age": _int(0, 120)}),
    _object({"ok": BOOL}),
    _object({"color": _enum("red", "green", "blue")}),
    _object({"tags": _array(_text(), 1, 3)}),
    _object({"point": _object({"x": _int(-10, 10), "y": _int(-10, 10)})}),
    _object({"score": _number(0, 1)}),
    _object({"nickname": {"type": ["string", "null"], "maxLength": 10}}),
    _object({"title": _text(10), "year": _int(1900, 2030), "genre": _enum("drama", "comedy")}),
    _object({"items": _array(_object({"id": _int(1, 99), "qty": _int(1, 9)}), 1, 2)}),
    _object({"a": _int(0, 9), "b": _int(0, 9)}, required=["a"]),
    _object({"user": _object({"name": _text(), "email": _text(12)}), "active": BOOL}),
    _object({"matrix": _array(_array(_int(0, 9), 2, 2), 2, 2)}),
    _object({"status": _enum("open", "closed"), "count": _int(0, 1000)}),
    _object({"city": _text(10), "population": _int(0, 50_000_000)}),
    _object({"flags": _array(BOOL, 2, 4)}),
    _object({"temperature": _number(-50, 50), "unit": _enum("C", "F")}),
    _object({"answer": {"anyOf": [_int(0, 100), NULL]}}),
    _object({"book": _object({"title": _text(10), "author": _object({"last": _text()})})}),
    _object({"level": {"type": "integer", "enum": [1, 2, 3]}}),
    _object({"name": _text(), "pets": _array(_object({"kind": _enum("cat", "dog")}), 0, 2)}),
    _object({"yes": BOOL, "no": BOOL}),
    _object({"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}}),
    _object({"weekday": _enum("mon", "tue", "wed", "thu", "fri"), "hour": _int(0, 23)}),
    _object({"price": _number(0, 1000), "currency": _enum("USD", "EUR")}),
    _object({"words": _array(_text(6), 2, 2)}),
    _object({"meta": _object({"version": _int(1, 5), "draft": BOOL})}),
    _object({"reply": {"type": ["boolean", "null"]}}),
    _object({"lat": _number(-90, 90), "lon": _number(-180, 180)}),
    _object({"first": _text(), "middle": {"anyOf": [_text(), NULL]}, "last": _text()}),
    _object({"rgb": _array(_int(0, 255), 3, 3)}),
    _object({"person": _object({"name": _text(), "age": _int(0, 99), "wed": BOOL}, ["name"])}),
    _object({"sizes": _array(_enum("S", "M", "L"), 1, 3)}),
]
MAX_TOKENS = 150  # (the longest answer here: ~60 tokens)


@pytest.fixture(scope="module")
def client():
    # 64 rows at once: every request of a test in one batch (the KV cache of 512 positions
    # a row fits the default 4 GiB).
    with LLM(max_num_seqs=64, max_model_len=512) as llm:
        server = InProcess(llm, max_waiting=128)
        try:
            yield server.client()
        finally:
            server.stop()


def _chat(client, content="Reply in JSON.", **kwargs):
    return client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": content}],
        **{"max_tokens": MAX_TOKENS, "temperature": 0, **kwargs},
    )


def _all_at_once(function, jobs):
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: function(*job), jobs))


def test_every_answer_parses_and_validates_against_its_schema(client):
    def ask(number, schema, sampled):
        response_format = {
            "type": "json_schema",
            "json_schema": {"name": f"schema{number}", "schema": schema, "strict": True},
        }
        how = {"temperature": 0.8, "seed": number} if sampled else {"temperature": 0}
        return _chat(client, response_format=response_format, **how).choices[0]

    jobs = [(n, s, sampled) for sampled in (False, True) for n, s in enumerate(SCHEMAS)]
    for (_, schema, _), choice in zip(jobs, _all_at_once(ask, jobs), strict=True):
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_vllms_fields_and_the_completions_endpoint(client):
    regex, choices = r"[0-9]{3}-[a-z]{2,4}", ["yes", "no", "it depends"]
    grammar = 'root ::= "(" [0-9] "," [0-9] ")"'
    schema = _object({"n": _int(0, 9)})
    chats = {
        "guided_json": (schema, lambda text: jsonschema.validate(json.loads(text), schema)),
        "guided_regex": (regex, lambda text: _fullmatch(regex, text)),
        "guided_choice": (choices, lambda text: _is(text in choices, text)),
        "guided_grammar": (grammar, lambda text: _fullmatch(r"\([0-9],[0-9]\)", text)),
        "structured_outputs": ({"regex": "[A-Z]{4}"}, lambda text: _fullmatch("[A-Z]{4}", text)),
    }
    jobs = [(name, spec) for name, (spec, _) in chats.items()]
    answers = _all_at_once(lambda name, spec: _chat(client, extra_body={name: spec}), jobs)
    for (name, _), answer in zip(jobs, answers, strict=True):
        chats[name][1](answer.choices[0].message.content)
    completion = client.completions.create(  # (vLLM's completions take it too)
        model="tiny",
        prompt=["A JSON object:", "Some JSON:"],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    for choice in completion.choices:
        assert isinstance(json.loads(choice.text), dict) and choice.finish_reason == "stop"
    schema_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMAS[0]}}
    stream = _chat(client, response_format=schema_format, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    whole = _chat(client, response_format=schema_format).choices[0].message.content
    assert streamed == whole and json.loads(whole)
    plain = _chat(client, response_format={"type": "text"}, max_tokens=4)
    assert plain.choices[0].finish_reason == "length"


def _fullmatch(pattern, text):
    import re

    assert re.fullmatch(pattern, text), text


def _is(condition, text):
    assert condition, text


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "nonsense"}}}}, "response_format",
         'response_format.json_schema.schema is not valid: Unsupported type "nonsense"'),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format",
         "one structured output; this one gives response_format, guided_regex"),
        ({"guided_json": {"type": "object"}, "structured_outputs": {"regex": "a"}}, "guided_json",
         "one structured output; this one gives guided_json, structured_outputs"),
        ({"response_format": {"type": "xml"}}, "response_format",
         "response_format must be an object whose type is one of text, json_object, json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
         "response_format", "response_format.json_schema.name must be a string"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}},
         "response_format", "response_format.json_schema.schema uses uniqueItems at /, which "
         "xgrammar does not enforce"),
        ({"guided_regex": "(["}, "guided_regex", "guided_regex is not valid: Regex parsing error"),
        ({"guided_choice": "yes"}, "guided_choice", "must be a non-empty list of strings"),
        ({"guided_grammar": "root ::= "}, "guided_grammar", "guided_grammar is not valid: EBNF"),
        ({"guided_json": "{bad"}, "guided_json", "guided_json is not valid JSON"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs",
         "structured_outputs takes json, regex, choice, grammar, json_object"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
         "exactly one of json, regex, choice, grammar, json_object; got regex, choice"),
    ],
)  # fmt: skip
def test_each_bad_value_is_a_400_naming_its_field(client, body, param, needle):
    with pytest.raises(openai.BadRequestError) as error:
        _chat(client, extra_body=body)
    assert error.value.status_code == 400
    assert error.value.body["param"] == param and needle in error.value.body["message"]
    assert "\n" not in error.value.body["message"]


def test_without_xgrammar_a_structured_request_is_a_400_naming_the_extra(client, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # (import xgrammar: ImportError)
    with pytest.raises(openai.BadRequestError) as error:
        _chat(client, response_format={"type": "json_object"})
    assert error.value.body["message"] == (
        "structured outputs need the xgrammar package: pip install 'offload[structured]'"
    )
    assert _chat(client, max_tokens=2).choices[0].finish_reason == "length"  # (plain: no need)
