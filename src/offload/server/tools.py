"""A chat request's `tools` and `tool_choice`, as vLLM's server takes them: checked (each
bad one a 400 naming its field), given to the chat template, and the answer read back
into `tool_calls`. "auto" reads the model's text with the server's parser
(`--enable-auto-tool-choice --tool-call-parser NAME`); "required" and a named function
force the call with a grammar over a JSON schema, as vLLM does (structured outputs), and
need no parser; "none" answers text."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from offload.engine.sampling_params import SamplingParams
from offload.engine.structured import StructuredOutputsParams
from offload.errors import ConfigError, shown
from offload.server.protocol import APIError
from offload.server.tool_parsers import (
    TOOL_PARSERS,
    Parsed,
    RequiredToolParser,
    ToolCall,
    ToolParser,
    tool_parser,
)

# vLLM's words for each refusal.
AUTO_NEEDS_FLAGS = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)
_NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
_NO_PARAMETERS = {"type": "object", "properties": {}}  # (vLLM's schema of a tool without any)


@dataclass(frozen=True)
class ServerTools:
    """What the server was told of tools (vLLM's flags)."""

    parser: ToolParser | None = None  # --tool-call-parser
    enable_auto: bool = False  # --enable-auto-tool-choice
    exclude_when_none: bool = False  # --exclude-tools-when-tool-choice-none


def server_tools(
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    exclude_tools_when_tool_choice_none: bool = False,
) -> ServerTools:
    """The server's tool settings, checked as vLLM checks its flags (one-line errors)."""
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ConfigError(
            "--enable-auto-tool-choice requires --tool-call-parser (one of "
            f"{', '.join(TOOL_PARSERS)})"
        )
    parser = tool_parser(tool_call_parser) if tool_call_parser is not None else None
    return ServerTools(parser, enable_auto_tool_choice, exclude_tools_when_tool_choice_none)


@dataclass(frozen=True)
class ToolPlan:
    """One request's tools and what to do with them: `choice` is "none", "auto",
    "required" or "named" (`function`: the name); `parser` reads the answer's calls."""

    tools: list[dict[str, Any]]
    choice: str
    function: str | None = None
    parser: ToolParser | None = None
    parallel: bool = True  # parallel_tool_calls: false keeps the first call only
    template_tools: list[dict[str, Any]] | None = None  # what the chat template sees

    @property
    def reads_output(self) -> bool:
        return self.choice != "none"

    def adjust(self, params: SamplingParams) -> None:
        """The request's fresh `params` as its tools need them: a forced call's grammar, and
        the parser's markers kept in the text (vLLM's hermes parser asks for that)."""
        if self.choice == "auto" and self.parser.keeps_special_tokens:
            params.skip_special_tokens = False
        if self.choice not in ("required", "named"):
            return
        if self.choice == "named" and params.structured_outputs is not None:
            raise APIError(
                400, "You can only either use constraints for structured outputs or tools, "
                "not both.", "tool_choice",
            )  # fmt: skip
        # (vLLM: "required" replaces a structured output the request asked for)
        params.structured_outputs = _grammar(self._schema())

    def _schema(self) -> dict[str, Any]:
        functions = {tool["function"]["name"]: tool["function"] for tool in self.tools}
        if self.choice == "named":
            return functions[self.function].get("parameters") or _NO_PARAMETERS
        return _required_schema(list(functions.values()), self.parallel)

    def message(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a whole answer, and its finish reason."""
        if self.choice == "named":  # (vLLM: content "", finish reason "stop", as OpenAI)
            return _message("", [ToolCall(self.function, text)]), reason
        parsed = self.parser.parse(text) if self.reads_output else Parsed(text)
        calls = list(parsed.calls if self.parallel else parsed.calls[:1])
        if not calls:
            return _message(text), reason
        content = parsed.content if self.choice == "auto" else parsed.content or ""
        return _message(content, calls), self.reason(reason, called=True)

    def reason(self, reason: str | None, called: bool) -> str | None:
        """`"tool_calls"` where the model called and stopped ("auto", "required"); a call
        cut at max_tokens keeps "length"."""
        if called and reason == "stop" and self.choice in ("auto", "required"):
            return "tool_calls"
        return reason


def _message(content: str | None, calls: list[ToolCall] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [call.body() for call in calls]
    return message


def plan_of(body: Mapping[str, Any], server: ServerTools) -> ToolPlan | None:
    """The request's tools and tool_choice, checked as vLLM checks them (None: neither)."""
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice is None:  # (vLLM's default: "auto" where there are tools)
        choice = "auto" if tools else "none"
    if choice == "none":
        if tools is None:
            return None
        return ToolPlan(tools, "none", template_tools=None if server.exclude_when_none else tools)
    if tools is None:
        raise APIError(400, "When using `tool_choice`, `tools` must be set.", "tool_choice")
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else parallel  # (JSON null: unset)
    if not isinstance(parallel, bool):
        raise APIError(
            400, f"parallel_tool_calls must be true or false, got {shown(parallel)}",
            "parallel_tool_calls",
        )  # fmt: skip
    if choice == "auto":
        if not server.enable_auto or server.parser is None:
            raise APIError(400, AUTO_NEEDS_FLAGS, "tool_choice")
        return ToolPlan(tools, "auto", None, server.parser, parallel, tools)
    if choice == "required":
        return ToolPlan(tools, "required", None, RequiredToolParser(), parallel, tools)
    if isinstance(choice, dict):
        return ToolPlan(tools, "named", _named(choice, tools), None, parallel, tools)
    raise APIError(
        400, f"Invalid value for `tool_choice`: {shown(choice)}! Only named tools, \"none\", "
        "\"auto\" or \"required\" are supported.", "tool_choice",
    )  # fmt: skip


def _tools(value: object) -> list[dict[str, Any]] | None:
    """`tools`: a non-empty list of {"type": "function", "function": {"name", "description"?,
    "parameters"?}} (None where absent)."""
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise APIError(400, f"tools must be a non-empty list of tools, got {shown(value)}", "tools")
    for number, tool in enumerate(value):
        where = f"tools[{number}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise APIError(
                400, f'{where} must be {{"type": "function", "function": {{...}}}}, got '
                f"{shown(tool)}", "tools",
            )  # fmt: skip
        function = tool.get("function")
        if not isinstance(function, dict):
            raise APIError(
                400, f"{where}.function must be an object, got {shown(function)}", "tools"
            )
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"{where}.function.name must be a name, got {shown(name)}", "tools")
        for key, kind, what in (
            ("description", str, "a string"),
            ("parameters", dict, "an object"),
        ):
            if function.get(key) is not None and not isinstance(function[key], kind):
                raise APIError(
                    400, f"{where}.function.{key} must be {what}, got {shown(function[key])}",
                    "tools",
                )  # fmt: skip
    return value


def _named(choice: dict[str, Any], tools: list[dict[str, Any]]) -> str:
    """The function a named tool_choice names: one of `tools`'."""
    if choice.get("type", "function") != "function":
        raise APIError(400, f"Invalid `type` in `tool_choice`! {_NAMED_USAGE}", "tool_choice")
    function = choice.get("function")
    if not isinstance(function, dict):
        raise APIError(
            400, f"Invalid value for `function`: `{shown(function)}` in `tool_choice`! "
            f"{_NAMED_USAGE}", "tool_choice",
        )  # fmt: skip
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise APIError(
            400, f"Invalid `name` in `function`: `{shown(name)}` in `tool_choice`! "
            f"{_NAMED_USAGE}", "tool_choice",
        )  # fmt: skip
    if all(tool["function"]["name"] != name for tool in tools):
        raise APIError(
            400, f"The tool specified in `tool_choice` ({shown(name)}) does not match any of "
            "the specified `tools`", "tool_choice",
        )  # fmt: skip
    return name


def _required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """vLLM's schema of "required": a non-empty array of calls, each {"name": one tool's
    name, "parameters": that tool's schema}; their "$defs" gathered at the top, where
    their references point. Without parallel calls, one call at most."""
    items, defs = [], {}
    for function in functions:
        parameters = copy.deepcopy(function.get("parameters") or _NO_PARAMETERS)
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise APIError(
                    400, f"Tool definition '{name}' has multiple schemas, which is not "
                    "supported.", "tools",
                )  # fmt: skip
        properties = {"name": {"type": "string", "enum": [function["name"]]}}
        properties["parameters"] = parameters
        items.append({"properties": properties, "required": ["name", "parameters"]})
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": items},
    }
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _grammar(schema: dict[str, Any]) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(json=schema)
    except ConfigError as error:  # (its message names the tools' schema, not ours)
        message = str(error).replace("structured_outputs.json", "the tools' parameters schema")
        raise APIError(400, message, "tools") from None


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as chat templates take them: an assistant message's tool calls with
    their arguments as objects, not JSON text (vLLM's conversion; none given: {})."""
    converted = []
    for number, message in enumerate(messages):
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            message = {**message, "tool_calls": [_template_call(number, c) for c in calls]}
        converted.append(message)
    return converted


def _template_call(number: int, call: object) -> dict[str, Any]:
    where = f"messages[{number}].tool_calls[]"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise APIError(
            400, f"{where} must be objects with a function, got {shown(call)}", "messages"
        )
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise APIError(
                400, f"{where}.function.arguments must be JSON text, got {shown(arguments)}",
                "messages",
            ) from None  # fmt: skip
    return {**call, "function": {**function, "arguments": arguments}}
