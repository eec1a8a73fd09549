"""Where xgrammar's languages differ from what a client checks an answer with. JSON
schemas whose constraints xgrammar would not enforce are refused by name; every other
schema's grammar holds the output to it. Each probe pairs a schema with a value it
forbids: either `unenforced` names the schema's keyword, or xgrammar's grammar rejects the
value. Schemas users write (pydantic's shapes, the serving tests') are not refused. A
regular expression's dot skips newlines, as Python's `re` does."""

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.engine.schema_limits import unenforced
from offload.engine.structured import StructuredOutputsParams, single_line_dots
from offload.errors import ConfigError

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
testing = pytest.importorskip("xgrammar.testing")

INT, STR = {"type": "integer"}, {"type": "string"}


def _object(properties, **more):
    return {"type": "object", "properties": properties, "required": list(properties), **more}


# (keyword the refusal names, or None where xgrammar enforces it; schema; a value it forbids)
PROBES = [
    ("uniqueItems", {"type": "array", "items": INT, "uniqueItems": True}, [1, 1]),
    ("uniqueItems", _object({"r": {"type": "array", "items": {"enum": ["a", "b"]},
                                   "uniqueItems": True}}), {"r": ["a", "a"]}),
    ("contains", {"type": "array", "items": INT, "contains": {"const": 5}}, [1]),
    ("multipleOf", {"type": "number", "multipleOf": 0.5}, 0.3),
    ("multipleOf", {"type": "integer", "multipleOf": 2.5}, 4),
    (None, {"type": "integer", "multipleOf": 3}, 4),
    ("dependentRequired", {**_object({"a": INT, "b": INT}), "required": [],
                           "dependentRequired": {"a": ["b"]}}, {"a": 1}),
    ("dependentSchemas", {**_object({"a": INT}), "dependentSchemas": {"a": {"required": ["b"]}}},
     {"a": 1}),
    ("not", {"not": INT}, 1),
    ("if", {**_object({"a": INT, "b": INT}), "required": [], "if": {"required": ["a"]},
            "then": {"required": ["b"]}}, {"a": 1}),
    ("allOf", {"allOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 5}]},
     9),
    (None, {"allOf": [{"type": "integer", "maximum": 5}]}, 9),
    ("oneOf", {"oneOf": [INT, {"type": "number"}]}, 1),
    ("type beside oneOf", {"type": "integer", "oneOf": [{"minimum": 5}, {"maximum": 0}]}, "x"),
    ("maximum beside anyOf", {"type": "integer", "maximum": 5,
                              "anyOf": [{"minimum": 0}, {"maximum": -10}]}, 9),
    ("type beside anyOf", {"type": "object", "anyOf": [{"additionalProperties": INT},
                                                        {"patternProperties": {"^x": INT}}]}, [1]),
    (None, {"type": "object", "anyOf": [{"properties": {"a": INT}}, {"properties": {"b": INT}}]},
     "x"),
    (None, {"type": "array", "anyOf": [{"items": INT}, {"prefixItems": [STR]}]}, {"a": 1}),
    ("maximum beside $ref", {"$defs": {"n": INT}, "$ref": "#/$defs/n", "maximum": 5}, 9),
    (None, {"$defs": {"n": {"type": "integer", "maximum": 5}}, "$ref": "#/$defs/n"}, 9),
    ("minLength/maxLength", {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "abcdef"),
    ("minLength/maxLength", {"type": "string", "pattern": "^[a-z]+$", "minLength": 3}, "a"),
    ("minLength/maxLength", {"type": "string", "format": "email", "maxLength": 5}, "abc@def.com"),
    ("minimum without a type", {"minimum": 3}, 1),
    ("maxLength without a type", {"maxLength": 2}, "abc"),
    ("pattern beside enum", {"type": "string", "enum": ["ab", "cd"], "pattern": "^a"}, "cd"),
    ("enum values outside its type", {"type": "integer", "enum": [1, "a"]}, "a"),
    ("required 'b'", _object({"a": INT}, required=["a", "b"]), {"a": 1}),
    ("required 'a'", {"type": "object", "additionalProperties": INT, "required": ["a"]}, {}),
    (None, _object({"a": INT}), {}),
    (None, {"type": "object", "properties": {"a": INT, "b": INT}, "maxProperties": 1},
     {"a": 1, "b": 2}),
    (None, {"type": "object", "patternProperties": {"^x": INT}}, {"xa": "s"}),
    (None, {"type": "string", "format": "date"}, "hello"),
    (None, {"type": "number", "exclusiveMinimum": 0}, 0),
    (None, {"type": ["integer", "null"], "minimum": 3, "maximum": 5}, 9),
    (None, {"type": "string", "minLength": 2, "maxLength": 3}, "abcd"),
    (None, {"anyOf": [{"type": "integer", "maximum": 3}, STR]}, 4),
    (None, {"oneOf": [INT, STR]}, [1]),
    (None, {"oneOf": [_object({"k": {"const": "a"}, "v": INT}),
                      _object({"k": {"const": "b"}, "w": STR})]}, {"k": "a", "w": "x"}),
    (None, {"type": "array", "items": {"type": "string", "maxLength": 2}, "maxItems": 1},
     ["abc"]),
]  # fmt: skip


def _grammar(schema):
    spec = StructuredOutputsParams.__new__(StructuredOutputsParams)
    spec.disable_any_whitespace = False  # (the options a request gets by default)
    return xgr.Grammar.from_json_schema(json.dumps(schema), **spec.json_options)


@pytest.mark.parametrize(("refused", "schema", "value"), PROBES)
def test_a_schema_is_refused_by_name_or_its_grammar_forbids_what_it_forbids(refused, schema, value):
    validator = jsonschema.validators.validator_for(schema)
    checker = validator(schema, format_checker=validator.FORMAT_CHECKER)
    assert not checker.is_valid(value)  # (the probe: a value the schema forbids)
    found = unenforced(schema)
    if refused is None:
        assert found is None
        assert not testing._is_grammar_accept_string(_grammar(schema), json.dumps(value))
    else:
        assert found is not None and refused in found, found


# What pydantic writes, and shapes the serving tests use: none refused.
ADDRESS = _object({"street": STR, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})
CAT = _object({"kind": {"const": "cat", "title": "Kind"}, "lives": INT}, title="Cat")
DOG = _object({"kind": {"enum": ["dog"]}, "barks": {"type": "boolean"}}, title="Dog")
ACCEPTED = [
    {"$defs": {"Address": ADDRESS}, **_object({"home": {"$ref": "#/$defs/Address"},
     "work": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}], "default": None}})},
    {"$defs": {"Cat": CAT, "Dog": DOG}, **_object({"pet": {
        "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
        "discriminator": {"propertyName": "kind"}, "title": "Pet"}})},
    {"$defs": {"Color": {"enum": ["red", "green"], "title": "Color", "type": "string"}},
     **_object({"color": {"$ref": "#/$defs/Color", "description": "a color"}})},
    _object({"tags": {"type": "array", "items": STR, "minItems": 1, "maxItems": 3},
             "score": {"type": "number", "minimum": 0, "maximum": 1},
             "level": {"type": "integer", "enum": [1, 2, 3]},
             "nick": {"type": ["string", "null"], "maxLength": 10},
             "reply": {"type": ["boolean", "null"]}}),
    {"type": "object", "anyOf": [_object({"a": INT}), _object({"b": STR})]},
    {"type": "array", "items": {"type": "array", "items": INT, "uniqueItems": False}},
]  # fmt: skip


@pytest.mark.parametrize("schema", ACCEPTED)
def test_the_schemas_users_write_are_not_refused(schema):
    assert unenforced(schema) is None
    StructuredOutputsParams(json=schema)  # (and xgrammar parses it)


def test_the_refusal_is_one_line_naming_the_keyword_and_where_it_is():
    schema = _object({"user": _object({"roles": {"type": "array", "items": STR,
                                                 "uniqueItems": True}})})  # fmt: skip
    with pytest.raises(ConfigError) as error:
        StructuredOutputsParams(json=json.dumps(schema))
    message = str(error.value)
    assert message.startswith("structured_outputs.json uses uniqueItems at ")
    assert "/properties/user/properties/roles" in message and "\n" not in message


PIECES = ["a", "b", ".", "\\.", "\\\\", "[.a]", "[^a]", "[^.]", "[]a]", "[a[]", "(a|.)", "\n"]
TEXT = st.text(alphabet="ab.\n]\\[", max_size=6)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(PIECES), st.sampled_from(["", "*", "+", "?"])),
                min_size=1, max_size=4), st.lists(TEXT, min_size=1, max_size=8))  # fmt: skip
def test_a_regex_keeps_its_meaning_in_python_and_its_dots_skip_newlines(parts, texts):
    pattern = "".join(piece + quantifier for piece, quantifier in parts)
    written = single_line_dots(pattern)
    try:
        grammar = xgr.Grammar.from_regex(written)
    except RuntimeError:
        grammar = None  # (a class xgrammar does not parse, "[]a]": the request is refused)
    for text in texts:
        meant = re.fullmatch(pattern, text) is not None
        assert (re.fullmatch(written, text) is not None) == meant, (pattern, written, text)
        if grammar is not None and testing._is_grammar_accept_string(grammar, text):
            assert meant, (pattern, written, text)  # (what xgrammar lets out, re accepts)


def test_without_the_rewrite_xgrammars_dot_takes_a_newline():
    grammar = xgr.Grammar.from_regex("a.b")  # (why the rewrite: drop it and the test above fails)
    assert testing._is_grammar_accept_string(grammar, "a\nb") and not re.fullmatch("a.b", "a\nb")
    assert StructuredOutputsParams(regex="a.b").spec == "a[^\\n]b"
