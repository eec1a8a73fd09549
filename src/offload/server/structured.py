"""A request's structured output, in each shape the OpenAI client and vLLM's server take:
`response_format` ({"type": "text" | "json_object" | "json_schema"}), vLLM's
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, and its
`structured_outputs` object; at most one of them per request."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from offload.engine.structured import KINDS, StructuredOutputsParams
from offload.errors import ConfigError, shown

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}  # fmt: skip
_FORMATS = ("text", "json_object", "json_schema")


class FieldError(ValueError):
    """A bad structured-output field: its name (the 400's `param`) and why."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def structured_outputs_of(body: Mapping[str, Any]) -> StructuredOutputsParams | None:
    """The request's structured output (None: it asks for none), checked: a bad one is
    a `FieldError` naming the request's field."""
    # field -> (its keyword arguments, the spec's name in the request: None, as ours)
    given: dict[str, tuple[dict, str | None]] = {}
    response_format = _response_format(body)
    if response_format is not None:
        given["response_format"] = response_format
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            given[name] = ({kind: body[name]}, name)
    if body.get("structured_outputs") is not None:
        given["structured_outputs"] = (_structured_outputs(body), None)
    if len(given) > 1:
        names = ", ".join(given)
        raise FieldError(
            next(iter(given)),
            f"a request may ask for one structured output; this one gives {names}",
        )
    if not given:
        return None
    param, (kwargs, where) = next(iter(given.items()))
    try:
        return StructuredOutputsParams(**kwargs)
    except ConfigError as error:  # (its message names the spec as the request does)
        message = str(error)
        for kind in KINDS if where is not None else ():
            message = message.replace(f"structured_outputs.{kind} ", f"{where} ", 1)
        raise FieldError(param, message) from None


def _response_format(body: Mapping[str, Any]) -> tuple[dict, str] | None:
    """`response_format` as keyword arguments (None: absent or plain text)."""
    value = body.get("response_format")
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in _FORMATS:
        raise FieldError(
            "response_format",
            f"response_format must be an object whose type is one of {', '.join(_FORMATS)}, "
            f"got {shown(value)}",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}, "response_format"
    spec = value.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise FieldError("response_format", f"{where} must be an object, got {shown(spec)}")
    if not isinstance(spec.get("name"), str):
        raise FieldError(
            "response_format", f"{where}.name must be a string, got {shown(spec.get('name'))}"
        )
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise FieldError(
            "response_format", f"{where}.strict must be true or false, got {shown(spec['strict'])}"
        )
    schema = spec.get("schema")
    if schema is None:
        raise FieldError("response_format", f"{where}.schema is required")
    return {"json": schema}, f"{where}.schema"


def _structured_outputs(body: Mapping[str, Any]) -> dict:
    value = body["structured_outputs"]
    if not isinstance(value, dict):
        raise FieldError(
            "structured_outputs", f"structured_outputs must be an object, got {shown(value)}"
        )
    unknown = sorted(set(value) - set(StructuredOutputsParams.FIELDS))
    if unknown:
        raise FieldError(
            "structured_outputs",
            f"structured_outputs takes {', '.join(StructuredOutputsParams.FIELDS)}; "
            f"got {', '.join(map(repr, unknown))}",
        )
    return {name: item for name, item in value.items() if item is not None}
