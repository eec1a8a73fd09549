"""Tool calling through the server and the openai client, on the default model with a
Qwen2.5-style (hermes) and a Llama-3.1-style (llama3_json) chat template given per request:
"auto" parses what the model wrote (a regex makes this small model write the call format,
its values its own choice), "required" and a named function force the call by grammar,
streamed deltas join into the whole answer's calls, and bad requests are 400s naming the
field."""

import json
import re

import openai
import pytest
from http_server import InProcess

from offload import LLM

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

# Qwen2.5's template, shortened: the tools in the system prompt, earlier calls as
# <tool_call> blocks (arguments as objects), tool results as <tool_response>.
QWEN = """{%- if tools %}<|im_start|>system
You are a helpful assistant.

# Tools

You may call one or more functions to assist with the user query.

<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# Llama 3.1's, shortened: JSON calls with "parameters", after <|python_tag|>.
LLAMA = """<|start_header_id|>system<|end_header_id|>

Environment: ipython
{% if tools %}To call a function, respond with JSON for a function call in the format \
{"name": function name, "parameters": dictionary of argument name and its value}.
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}{% endif %}<|eot_id|>
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}\
<|start_header_id|>assistant<|end_header_id|>

<|python_tag|>{% for call in message.tool_calls %}{"name": "{{ call.function.name }}", \
"parameters": {{ call.function.arguments | tojson }}}{% if not loop.last %}; {% endif %}\
{% endfor %}<|eom_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}{% endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather of "
     "a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
     "parameters": TIME}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]
# The call formats, each value left to the model (greedy: its most likely one).
HERMES_CALLS = (
    r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": '
    r'"(Paris|Rome|Oslo)", "unit": "(C|F)"\}\}\n</tool_call>\n<tool_call>\n\{"name": '
    r'"get_time", "arguments": \{"zone": "(CET|UTC)"\}\}\n</tool_call>'
)
LLAMA_CALLS = (
    r'<\|python_tag\|>\{"name": "get_weather", "parameters": \{"city": "(Paris|Rome|Oslo)", '
    r'"unit": "(C|F)"\}\}; \{"name": "get_time", "parameters": \{"zone": "(CET|UTC)"\}\}'
)
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def servers():
    """One model, three servers: --tool-call-parser hermes and llama3_json (with
    --enable-auto-tool-choice), and one without tool flags."""
    with LLM(max_num_seqs=8, max_model_len=512) as llm:
        made = {
            "hermes": InProcess(llm, trust_request_chat_template=True,
                                enable_auto_tool_choice=True, tool_call_parser="hermes"),
            "llama3_json": InProcess(llm, trust_request_chat_template=True,
                                     enable_auto_tool_choice=True, tool_call_parser="llama3_json"),
            "plain": InProcess(llm, trust_request_chat_template=True),
        }  # fmt: skip
        try:
            yield {name: server.client() for name, server in made.items()}
        finally:
            for server in made.values():
                server.stop()


def _chat(client, template=QWEN, messages=QUESTION, **kwargs):
    extra = {"chat_template": template, **kwargs.pop("extra_body", {})}
    return client.chat.completions.create(
        model="tiny", messages=messages, extra_body=extra,
        **{"max_tokens": MAX_TOKENS, "temperature": 0, **kwargs},
    )  # fmt: skip


def _calls(message):
    return [
        (call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls
    ]


def _streamed(client, **kwargs):
    """A streamed chat's deltas joined: content, calls (name, arguments text) by index,
    ids, and the finish reason."""
    content, calls, ids, reason = "", {}, {}, None
    for chunk in _chat(client, stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", ""])
            entry[0] += call.function.name or ""
            entry[1] += call.function.arguments or ""
            ids.setdefault(call.index, call.id)
        reason = choice.finish_reason or reason
    return content, [tuple(calls[i]) for i in sorted(calls)], ids, reason


def _as_sent(message):
    return [(call.function.name, call.function.arguments) for call in message.tool_calls]


@pytest.mark.parametrize(
    ("parser", "template", "regex", "content"),
    [("hermes", QWEN, HERMES_CALLS, "Let me check.\n"), ("llama3_json", LLAMA, LLAMA_CALLS, None)],
)
def test_auto_parses_the_calls_the_model_wrote(servers, parser, template, regex, content):
    client = servers[parser]
    raw = _chat(
        client, template, tools=TOOLS, tool_choice="none", extra_body={"guided_regex": regex}
    )
    written = raw.choices[0].message.content  # (the same prompt and greedy: the same text)
    assert raw.choices[0].message.tool_calls is None and re.fullmatch(regex, written)
    answer = _chat(client, template, tools=TOOLS, extra_body={"guided_regex": regex})
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == content
    values = re.fullmatch(regex, written).groups()  # (the model's own choice of each value)
    assert _calls(choice.message) == [
        ("get_weather", {"city": values[0], "unit": values[1]}),
        ("get_time", {"zone": values[2]}),
    ]
    ids = [call.id for call in choice.message.tool_calls]
    assert len(set(ids)) == 2 and all(re.fullmatch("chatcmpl-tool-[0-9a-f]{32}", i) for i in ids)
    assert all(call.type == "function" for call in choice.message.tool_calls)
    streamed, calls, _, reason = _streamed(client, template=template, tools=TOOLS,
                                           extra_body={"guided_regex": regex})  # fmt: skip
    assert (streamed or None, calls, reason) == (content, _as_sent(choice.message), "tool_calls")


def test_required_and_named_are_forced_by_grammar_without_the_auto_flag(servers):
    client = servers["plain"]
    required = _chat(client, tools=TOOLS, tool_choice="required").choices[0]
    assert required.finish_reason == "tool_calls" and required.message.content == ""
    assert required.message.tool_calls
    for name, arguments in _calls(required.message):
        jsonschema.validate(arguments, SCHEMAS[name])
    named_choice = {"type": "function", "function": {"name": "get_time"}}
    named = _chat(client, tools=TOOLS, tool_choice=named_choice).choices[0]
    assert named.finish_reason == "stop"  # (vLLM's and OpenAI's, for a named function)
    ((name, arguments),) = _calls(named.message)
    assert name == "get_time" and jsonschema.validate(arguments, TIME) is None
    for choice, whole in (("required", required), (named_choice, named)):
        content, calls, ids, reason = _streamed(client, tools=TOOLS, tool_choice=choice)
        assert (content, calls, reason) == ("", _as_sent(whole.message), whole.finish_reason)
        assert all(i.startswith("chatcmpl-tool-") for i in ids.values())
    one = _chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1


def test_text_without_a_valid_call_stays_content(servers):
    broken = (
        r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": (CET|UTC)\}\}\n</tool_call>'
    )
    answer = _chat(servers["hermes"], tools=TOOLS, extra_body={"guided_regex": broken})
    choice = answer.choices[0]  # (the zone unquoted: not JSON)
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert re.fullmatch(broken, choice.message.content)
    plain = _chat(servers["hermes"], tools=TOOLS, max_tokens=8).choices[0]
    assert plain.message.tool_calls is None and plain.message.content


def test_a_conversation_with_calls_and_their_results_renders(servers):
    call = {"id": "chatcmpl-tool-1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}  # fmt: skip
    history = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "21 C, sunny"},
    ]
    for template in (QWEN, LLAMA):
        answer = _chat(servers["hermes"], template, messages=history, tools=TOOLS, max_tokens=4)
        assert answer.choices[0].finish_reason == "length"
        assert answer.usage.prompt_tokens > 100  # (the tools and the call were rendered)


@pytest.mark.parametrize(
    ("server", "kwargs", "param", "needle"),
    [
        ("plain", {"tools": TOOLS}, "tool_choice", '"auto" tool choice requires '
         "--enable-auto-tool-choice and --tool-call-parser to be set"),
        ("hermes", {"tools": []}, "tools", "tools must be a non-empty list of tools"),
        ("hermes", {"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools",
         "tools[0].function.name must be a name"),
        ("hermes", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {
            "name": "get_stock"}}}, "tool_choice", "does not match any of the specified `tools`"),
        ("hermes", {"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
        ("hermes", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {
            "name": "get_time"}}, "response_format": {"type": "json_object"}}, "tool_choice",
         "either use constraints for structured outputs or tools, not both"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s_naming_the_field(servers, server, kwargs, param, needle):
    with pytest.raises(openai.BadRequestError) as error:
        _chat(servers[server], **kwargs)
    assert error.value.body["param"] == param and needle in error.value.body["message"]
