"""Tool calls without a model: the parsers (text to calls, both whole and streamed), a
request's tools and tool_choice checked as vLLM checks them, the server's flags, and
assistant tool calls given to a chat template as objects."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from offload.cli.main import main
from offload.errors import ConfigError
from offload.server.protocol import APIError
from offload.server.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    RequiredToolParser,
    tool_parser,
)
from offload.server.tool_stream import ToolStream
from offload.server.tools import (
    AUTO_NEEDS_FLAGS,
    ToolPlan,
    plan_of,
    server_tools,
    template_messages,
)

HERMES, LLAMA, REQUIRED = HermesToolParser(), Llama3JsonToolParser(), RequiredToolParser()
WEATHER = {"city": "Paris", "unit": "C"}
TIME = {"zone": "Europe/Zürich"}


def _hermes_call(name, arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _calls(parsed):
    return [(call.name, json.loads(call.arguments)) for call in parsed.calls]


def test_hermes_reads_several_calls_after_text():
    text = "Let me look.\n" + _hermes_call("weather", WEATHER) + "\n" + _hermes_call("time", TIME)
    parsed = HERMES.parse(text)
    assert parsed.content == "Let me look.\n"
    assert _calls(parsed) == [("weather", WEATHER), ("time", TIME)]
    assert all(isinstance(call.arguments, str) for call in parsed.calls)  # JSON text
    assert "Zürich" in parsed.calls[1].arguments  # (not escaped: vLLM's ensure_ascii=False)
    ids = {call.id for call in parsed.calls}
    assert len(ids) == 2 and all(i.startswith("chatcmpl-tool-") and len(i) == 46 for i in ids)


def test_hermes_content_is_none_before_a_first_call_and_an_unclosed_last_call_reads():
    parsed = HERMES.parse('<tool_call>{"name": "time", "arguments": {}}')  # (cut at EOS)
    assert parsed.content is None and _calls(parsed) == [("time", {})]


@pytest.mark.parametrize(
    "text",
    [
        "No call here, just text.",
        'Sure <tool_call>{"name": "weather", "arguments": {"city": "Par</tool_call>',  # bad JSON
        '<tool_call>{"name": "weather"}</tool_call>',  # no arguments
        '<tool_call>{"name": "weather", "arguments": "city=Paris"}</tool_call>',  # not an object
        '<tool_call>["weather"]</tool_call>',
        _hermes_call("weather", WEATHER) + '<tool_call>{"oops"}</tool_call>',  # one bad of two
    ],
)
def test_hermes_text_without_a_valid_call_stays_content(text):
    parsed = HERMES.parse(text)
    assert parsed.content == text and parsed.calls == ()


def test_llama3_json_reads_calls_with_or_without_the_python_tag():
    one = '{"name": "weather", "parameters": {"city": "Paris", "unit": "C"}}'
    two = '<|python_tag|>{"name": "weather", "parameters": {"city": "Paris", "unit": "C"}}; ' + (
        '{"name": "time", "arguments": {"zone": "Europe/Zürich"}}'
    )
    assert _calls(LLAMA.parse(one)) == [("weather", WEATHER)]
    parsed = LLAMA.parse(two)
    assert parsed.content is None and _calls(parsed) == [("weather", WEATHER), ("time", TIME)]


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        'I will call {"name": "weather", "parameters": {}}',  # (a call must start the answer)
        '{"name": "weather", "parameters": {"city": "Pa',  # cut short
        '{"name": "weather", "parameters": {}} and more',
        '{"name": "weather", "parameters": {}}; {"nam": "time", "parameters": {}}',
        '{"city": "Paris"}',  # JSON, but no call
    ],
)
def test_llama3_json_text_without_valid_calls_stays_content(text):
    parsed = LLAMA.parse(text)
    assert parsed.content == text and parsed.calls == ()


def test_required_reads_the_array_its_grammar_makes():
    text = json.dumps(
        [{"name": "weather", "parameters": WEATHER}, {"name": "time", "parameters": TIME}]
    )
    assert _calls(REQUIRED.parse(text)) == [("weather", WEATHER), ("time", TIME)]
    assert REQUIRED.parse("[]").calls == () and REQUIRED.parse('[{"name": "a"').calls == ()


CALL_TEXTS = [
    (HERMES, "I will look.\n" + _hermes_call("weather", WEATHER) + "\n" + _hermes_call("time", TIME)),
    (HERMES, _hermes_call("time", TIME)[: -len("</tool_call>")]),  # (unclosed: read at the end)
    (HERMES, "Just text with a < sign and <tool but no call."),
    (LLAMA, '<|python_tag|>{"name": "weather", "parameters": {"city": "Paris", "unit": "C"}}; '
     '{"name": "time", "parameters": {"zone": "Europe/Zürich"}}'),
    (LLAMA, "  <|python_ta and text"),
    (REQUIRED, json.dumps([{"name": "weather", "parameters": WEATHER}, {"name": "time", "parameters": TIME}])),
]  # fmt: skip


def _streamed(plan, text, cuts):
    """The deltas of `text` streamed in pieces ending at `cuts`, joined: content, calls
    (name, arguments) by index, and whether any call was sent."""
    stream, content, calls = ToolStream(plan), "", {}
    ends = sorted({*cuts, len(text)})
    for end in ends:
        delta = stream.delta(text[:end], finished=end == len(text))
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] += call["function"].get("name", "")
            entry["arguments"] += call["function"]["arguments"]
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], stream.called


@pytest.mark.parametrize(("parser", "text"), CALL_TEXTS)
@given(cuts=st.lists(st.integers(0, 400), max_size=30))
def test_streamed_deltas_join_into_the_whole_answers_calls(parser, text, cuts):
    choice = "required" if parser is REQUIRED else "auto"
    plan = ToolPlan([], choice, parser=parser)
    message, _ = plan.message(text, "stop")
    content, calls, called = _streamed(plan, text, [c for c in cuts if c < len(text)])
    whole = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])
    ]
    assert calls == whole and called == bool(whole)
    assert content == (message["content"] or "")


def test_every_character_streamed_alone_gives_the_same_calls():
    for parser, text in CALL_TEXTS:
        plan = ToolPlan([], "required" if parser is REQUIRED else "auto", parser=parser)
        message, _ = plan.message(text, "stop")
        whole = [
            (c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls", [])
        ]
        assert _streamed(plan, text, range(len(text)))[1] == whole


@pytest.mark.parametrize("bad", ['<tool_call>{"bad</tool_call>', '<tool_call>{"cut short'])
def test_a_bad_call_after_a_streamed_one_is_dropped_not_taken_back(bad):
    text = _hermes_call("weather", WEATHER) + bad
    plan = ToolPlan([], "auto", parser=HERMES)
    assert plan.message(text, "stop")[0] == {"role": "assistant", "content": text}
    assert _streamed(plan, text, [])[:2] == (text, [])  # (in one piece: as whole)
    cut = len(_hermes_call("weather", WEATHER))
    content, calls, called = _streamed(plan, text, [cut])  # (the good call sent first)
    assert content == "" and calls == [("weather", json.dumps(WEATHER))] and called


def test_a_named_calls_arguments_stream_as_they_come():
    plan = ToolPlan([], "named", function="weather")
    stream = ToolStream(plan)
    first = stream.delta('{"city": ', finished=False)["tool_calls"][0]
    assert first["function"] == {"name": "weather", "arguments": '{"city": '}
    assert first["id"].startswith("chatcmpl-tool-") and first["type"] == "function"
    rest = stream.delta('{"city": "Rome"}', finished=True)["tool_calls"][0]
    assert rest == {"index": 0, "function": {"arguments": '"Rome"}'}}
    message, reason = plan.message('{"city": "Rome"}', "stop")
    assert message["content"] == "" and reason == "stop"  # (vLLM's and OpenAI's, named)


def test_finish_reason_is_tool_calls_where_auto_or_required_called_and_stopped():
    plan = ToolPlan([], "auto", parser=HERMES)
    assert plan.message(_hermes_call("time", TIME), "stop")[1] == "tool_calls"
    assert plan.message(_hermes_call("time", TIME), "length")[1] == "length"
    assert plan.message("plain", "stop") == ({"role": "assistant", "content": "plain"}, "stop")
    one = ToolPlan([], "auto", parser=HERMES, parallel=False)
    text = _hermes_call("time", TIME) + _hermes_call("weather", WEATHER)
    assert [c["function"]["name"] for c in one.message(text, "stop")[0]["tool_calls"]] == ["time"]


# -- a request's tools and tool_choice -----------------------------------------------

TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
AUTO = server_tools(True, "hermes")


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"tools": []}, "tools", "tools must be a non-empty list"),
        ({"tools": {"a": 1}}, "tools", "tools must be a non-empty list"),
        ({"tools": [{"type": "retrieval"}]}, "tools", 'tools[0] must be {"type": "function"'),
        ({"tools": [{"type": "function"}]}, "tools", "tools[0].function must be an object"),
        ({"tools": [TOOL, {"function": {"name": ""}}]}, "tools", "tools[1].function.name must"),
        ({"tools": [{"function": {"name": "f", "parameters": "x"}}]}, "tools",
         "tools[0].function.parameters must be an object"),
        ({"tools": [{"function": {"name": "f", "description": 3}}]}, "tools",
         "tools[0].function.description must be a string"),
        ({"tool_choice": "auto"}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
        ({"tools": [TOOL], "tool_choice": "always"}, "tool_choice",
         "Invalid value for `tool_choice`: 'always'"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "The tool specified in `tool_choice` ('nope') does not match any"),
        ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice",
         "Invalid value for `function`"),
        ({"tools": [TOOL], "tool_choice": {"function": {"name": 5}}}, "tool_choice",
         "Invalid `name` in `function`"),
        ({"tools": [TOOL], "parallel_tool_calls": "no"}, "parallel_tool_calls", "true or false"),
    ],
)  # fmt: skip
def test_each_bad_tools_field_is_a_400_naming_it(body, param, needle):
    with pytest.raises(APIError) as caught:
        plan_of(body, AUTO)
    assert caught.value.status == 400 and caught.value.param == param
    assert needle in caught.value.message and "\n" not in caught.value.message


def test_auto_needs_the_servers_flags_and_the_others_do_not():
    with pytest.raises(APIError) as caught:
        plan_of({"tools": [TOOL]}, server_tools())  # (tools given: "auto" by default)
    assert caught.value.message == AUTO_NEEDS_FLAGS and caught.value.param == "tool_choice"
    with pytest.raises(APIError):
        plan_of({"tools": [TOOL], "tool_choice": "auto"}, server_tools(tool_call_parser="hermes"))
    assert (
        plan_of({"tools": [TOOL], "tool_choice": "required"}, server_tools()).choice == "required"
    )
    named = {"type": "function", "function": {"name": "weather"}}
    assert plan_of({"tools": [TOOL], "tool_choice": named}, server_tools()).function == "weather"
    none = plan_of({"tools": [TOOL], "tool_choice": "none"}, server_tools())
    assert none.template_tools == [TOOL] and not none.reads_output
    excluded = plan_of({"tools": [TOOL], "tool_choice": "none"}, server_tools(False, None, True))
    assert excluded.template_tools is None
    assert plan_of({"messages": []}, server_tools()) is None


def test_the_servers_flags_are_checked_in_one_line():
    with pytest.raises(ConfigError, match="--enable-auto-tool-choice requires --tool-call-parser"):
        server_tools(enable_auto_tool_choice=True)
    with pytest.raises(ConfigError) as caught:
        tool_parser("qwen")
    assert str(caught.value) == (
        "--tool-call-parser 'qwen' is not a tool call parser; choose one of hermes, llama3_json"
    )


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--tool-call-parser", "mistral"], "'mistral' is not a tool call parser; choose one of "
         "hermes, llama3_json"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
    ],
)  # fmt: skip
def test_offload_serve_refuses_bad_tool_flags_before_loading(flags, needle, capsys):
    assert main(["serve", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("offload: error: ") and needle in err


def test_assistant_tool_calls_reach_the_template_with_arguments_as_objects():
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "20 C"},
    ]
    converted = template_messages(messages)
    assert converted[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert converted[2] == messages[2] and messages[1]["tool_calls"][0] is call  # (a copy)
    assert call["function"]["arguments"] == '{"city": "Paris"}'
    broken = [
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{"}}]}
    ]
    with pytest.raises(APIError) as caught:
        template_messages(broken)
    assert (
        caught.value.param == "messages" and "arguments must be JSON text" in caught.value.message
    )
