"""Tool-call parsers, by vLLM's names (`--tool-call-parser`): a model's text into OpenAI
tool calls. `hermes` reads the Qwen2.5/Qwen3 and Hermes templates' format (text, then
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks); `llama3_json` the
Llama 3.1/3.2 one (JSON objects `{"name": ..., "parameters": {...}}` separated by `;`,
after an optional `<|python_tag|>`). Pure text to calls: a text with no call, or with any
call that does not parse, is plain content (as vLLM answers it)."""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from offload.errors import ConfigError, shown

_DECODER = json.JSONDecoder()


def new_tool_call_id() -> str:
    """vLLM's id of a tool call: "chatcmpl-tool-" and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI's API carries it
    id: str = field(default_factory=new_tool_call_id)

    def body(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class Parsed:
    """A model's text read by a parser: its calls (none: the text is plain content) and
    the text before them (None where there is none)."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()


class ToolParser(ABC):
    """One format of tool calls. `parse` reads a whole answer; `partial` a streamed one
    still growing, so that its content goes out at once and each call once complete."""

    name: ClassVar[str]
    keeps_special_tokens: ClassVar[bool] = False  # the format's markers may be special tokens

    @abstractmethod
    def parse(self, text: str) -> Parsed:
        """The calls of a whole answer, or all of it as content."""

    @abstractmethod
    def partial(self, text: str) -> tuple[int, list[ToolCall]]:
        """Of a text that may still grow: the length of its start that is surely content,
        and the calls complete so far (in order, as `parse` would find them)."""


class HermesToolParser(ToolParser):
    name = "hermes"
    keeps_special_tokens = True  # (vLLM's: <tool_call> is a special token in some vocabularies)
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
    _CLOSED = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> Parsed:
        start = text.find(self.START)
        if start < 0:
            return Parsed(text)
        calls = []
        for closed, unclosed in self._BLOCK.findall(text):  # (the last may be unclosed)
            call = _call_of_json(closed or unclosed, ("arguments",))
            if call is None:
                return Parsed(text)
            calls.append(call)
        return Parsed(text[:start] or None, tuple(calls))

    def partial(self, text: str) -> tuple[int, list[ToolCall]]:
        start = text.find(self.START)
        if start < 0:  # (a tail that may be the marker's start waits for the next text)
            return len(text) - _marker_prefix(text, self.START), []
        calls = []
        for block in self._CLOSED.finditer(text):
            call = _call_of_json(block.group(1), ("arguments",))
            if call is None:
                break
            calls.append(call)
        return start, calls


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"
    _KEYS = ("arguments", "parameters")  # (vLLM's: "arguments" where given)

    def parse(self, text: str) -> Parsed:
        body = self._calls_text(text)
        if body is None:
            return Parsed(text)
        calls, whole = _objects(body, self._KEYS, ";", ("", ";"))
        return Parsed(None, tuple(calls)) if whole and calls else Parsed(text)

    def partial(self, text: str) -> tuple[int, list[ToolCall]]:
        begun = text.lstrip()
        if not begun or self.TAG.startswith(begun):
            return 0, []  # (calls or content: not known yet)
        body = self._calls_text(text)
        if body is None:
            return len(text), []
        return 0, _objects(body, self._KEYS, ";", ("", ";"))[0]

    def _calls_text(self, text: str) -> str | None:
        """What follows the tag, where the answer is calls (it starts with one)."""
        begun = text.lstrip()
        if begun.startswith(self.TAG):
            return begun[len(self.TAG) :]
        return begun if begun.startswith("{") else None


class RequiredToolParser(ToolParser):
    """`tool_choice="required"`: the JSON array of `{"name", "parameters"}` objects that
    its grammar makes the model write (vLLM's shape)."""

    name = "required"
    _KEYS = ("parameters",)

    def parse(self, text: str) -> Parsed:
        begun = text.lstrip()
        if not begun.startswith("["):
            return Parsed(text)
        calls, whole = _objects(begun[1:], self._KEYS, ",", ("]",))
        return Parsed(None, tuple(calls)) if whole and calls else Parsed(text)

    def partial(self, text: str) -> tuple[int, list[ToolCall]]:
        begun = text.lstrip()
        if not begun.startswith("["):
            return 0, []
        return 0, _objects(begun[1:], self._KEYS, ",", ("]",))[0]


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser)
}


def tool_parser(name: str, what: str = "--tool-call-parser") -> ToolParser:
    """The parser of that name, or the one-line error listing the names there are."""
    if name not in TOOL_PARSERS:
        raise ConfigError(
            f"{what} {shown(name)} is not a tool call parser; choose one of "
            f"{', '.join(TOOL_PARSERS)}"
        )
    return TOOL_PARSERS[name]()


def _call_of_json(text: str, keys: tuple[str, ...]) -> ToolCall | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return _call_of(value, keys)


def _call_of(value: object, keys: tuple[str, ...]) -> ToolCall | None:
    """The call a decoded object states: a string "name" and an object of arguments
    under the first of `keys` it has; None where it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    for key in keys:
        if key in value:
            arguments = value[key]
            if not isinstance(arguments, dict):
                return None
            return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))
    return None


def _objects(
    text: str, keys: tuple[str, ...], separator: str, ends: tuple[str, ...]
) -> tuple[list[ToolCall], bool]:
    """The calls of JSON objects written one after another with `separator` between them,
    as far as they read; and whether that is the whole text (what is left after the last
    call, spaces aside, one of `ends`)."""
    calls: list[ToolCall] = []
    at = 0
    while True:
        at = _past_spaces(text, at)
        try:
            value, at = _DECODER.raw_decode(text, at)
        except ValueError:
            return calls, False
        call = _call_of(value, keys)
        if call is None:
            return calls, False
        calls.append(call)
        at = _past_spaces(text, at)
        if text[at:].strip() in ends:
            return calls, True
        if not text.startswith(separator, at):
            return calls, False
        at += len(separator)


def _past_spaces(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _marker_prefix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
