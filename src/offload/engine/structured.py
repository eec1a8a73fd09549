"""`StructuredOutputsParams`: vLLM's names for constraining a request's output to a JSON
schema, a regular expression, one of a list of choices or a grammar. Each is checked
here, once, by parsing it with xgrammar (the grammar library vLLM defaults to), an
optional dependency imported only when a request asks for structured output; the token
masks are `grammars.py`'s."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from offload.engine.schema_limits import unenforced
from offload.errors import ConfigError, shown

MISSING = "structured outputs need the xgrammar package: pip install 'offload[structured]'"
KINDS = ("json", "regex", "choice", "grammar", "json_object")
# Whitespace between two JSON elements, at most: vLLM's xgrammar allows any amount, and a
# small model may then fill max_tokens with newlines (SmolLM2-135M did, greedy, for 2 of
# 32 schemas at 150 tokens); llama.cpp's schemas allow 2 newlines and 20 spaces or tabs.
MAX_WHITESPACE = 24


def xgrammar() -> Any:
    """The xgrammar module, or the one-line error naming the extra that installs it."""
    try:
        import xgrammar
    except ImportError:
        raise ConfigError(MISSING) from None
    return xgrammar


@dataclass
class StructuredOutputsParams:
    """What a request's output must match (vLLM's `StructuredOutputsParams`): exactly one
    of `json` (a JSON schema, as a dict or a JSON string), `regex`, `choice` (a list of
    strings: the output is one of them), `grammar` (an EBNF grammar in xgrammar's and
    llama.cpp's GBNF syntax, its start rule `root`) or `json_object=True` (any JSON
    object). `disable_any_whitespace` allows no whitespace but JSON's usual single spaces
    (small models may otherwise emit whitespace without end)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    FIELDS: ClassVar[tuple[str, ...]] = (*KINDS, "disable_any_whitespace")
    kind: str = field(init=False, repr=False)  # which of KINDS is set
    spec: str = field(init=False, repr=False)  # its text: the compiled grammar's key

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            found = f"got {', '.join(given)}" if given else "got none"
            raise ConfigError(
                f"structured_outputs must set exactly one of {', '.join(KINDS)}; {found}"
            )
        self.kind = given[0]
        self.spec = _spec_text(self.kind, getattr(self, self.kind))
        if not isinstance(self.disable_any_whitespace, bool):
            raise ConfigError(
                "structured_outputs.disable_any_whitespace must be true or false, "
                f"got {shown(self.disable_any_whitespace)}"
            )
        self.check()

    def check(self) -> None:
        """That the spec parses (without a tokenizer: the masks come later, per model)."""
        xgr = xgrammar()
        try:
            if self.kind == "json":
                xgr.Grammar.from_json_schema(self.spec, **self.json_options)
            elif self.kind == "regex":  # (the request's own text: its error positions)
                xgr.Grammar.from_regex(self.regex)
            elif self.kind in ("choice", "grammar"):
                xgr.Grammar.from_ebnf(self.spec)
        except (RuntimeError, ValueError, TypeError) as error:
            raise ConfigError(f"structured_outputs.{self.kind} {why(error)}") from None
        found = unenforced(json.loads(self.spec)) if self.kind == "json" else None
        if found is not None:  # (vLLM's xgrammar backend refuses these too)
            raise ConfigError(
                f"structured_outputs.json uses {found}, which xgrammar does not enforce "
                "(the output could break the schema); leave it out"
            )

    @property
    def json_options(self) -> dict[str, Any]:
        """How xgrammar writes a schema's grammar: any whitespace (a run of it bounded)
        unless `disable_any_whitespace`."""
        if self.disable_any_whitespace:
            return {"any_whitespace": False}
        return {"any_whitespace": True, "max_whitespace_cnt": MAX_WHITESPACE}


def why(error: BaseException) -> str:
    """xgrammar's reason, on one line: "is not valid: <its first line>"."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = lines[0] if lines else type(error).__name__
    # (xgrammar's C++ log prefix, "[15:02:03] /project/cpp/regex_converter.cc:94: ", cut)
    reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", reason)
    return f"is not valid: {reason[:300]}"


def _spec_text(kind: str, value: object) -> str:
    """The spec as the text xgrammar compiles: a schema's JSON, a choice list as a grammar."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as error:
                raise ConfigError(f"structured_outputs.json is not valid JSON: {error}") from None
        if not isinstance(value, dict | bool):
            raise ConfigError(
                f"structured_outputs.json must be a JSON schema (an object), got {shown(value)}"
            )
        try:
            return json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise ConfigError(f"structured_outputs.json is not JSON: {error}") from None
    if kind == "json_object":
        if value is not True:
            raise ConfigError(f"structured_outputs.json_object must be true, got {shown(value)}")
        return ""
    if kind == "choice":
        if (
            isinstance(value, str | bytes | dict)
            or not isinstance(value, list | tuple)
            or not value
            or not all(isinstance(c, str) for c in value)
        ):
            raise ConfigError(
                f"structured_outputs.choice must be a non-empty list of strings, got {shown(value)}"
            )
        return choice_grammar(value)
    if not isinstance(value, str) or not value:
        raise ConfigError(
            f"structured_outputs.{kind} must be a non-empty string, got {shown(value)}"
        )
    return single_line_dots(value) if kind == "regex" else value


def single_line_dots(pattern: str) -> str:
    """`pattern` with each `.` outside a character class written `[^\\n]`: the dot of
    Python's `re` (what a client checks an answer with), JavaScript's and most engines'
    skips a newline; xgrammar's takes one, so an answer could fail `re.fullmatch`."""
    out, at, first = [], 0, None  # first: where the open class's members begin
    while at < len(pattern):
        char = pattern[at]
        if char == "\\":
            out.append(pattern[at : at + 2])  # (an escape: `\\.` is a plain dot)
            at += 2
            continue
        if first is not None:
            if char == "^" and at == first:
                first += 1
            elif char == "]" and at > first:  # (first in a class, `]` is a member)
                first = None
        elif char == "[":
            first = at + 1
        elif char == ".":
            char = "[^\\n]"
        out.append(char)
        at += 1
    return "".join(out)


def choice_grammar(choices) -> str:
    """An EBNF grammar whose sentences are exactly `choices` (as vLLM writes it)."""
    return "root ::= " + " | ".join(f'"{"".join(map(_escaped, c))}"' for c in choices)


def _escaped(char: str) -> str:
    """One character inside an EBNF string literal."""
    if char in '\\"':
        return "\\" + char
    return f"\\u{ord(char):04x}" if ord(char) < 0x20 or char == "\x7f" else char


GuidedDecodingParams = StructuredOutputsParams  # (vLLM's older name)
