"""A request's body parsed and its chat rendered the way the server does it, without a
server: a request's own template refused unless trusted, and a trusted one stopped at its
time limit; text a tokenizer cannot take refused by field."""

import asyncio
import time
from types import SimpleNamespace

import pytest
from http_server import chat_checkpoint
from starlette.requests import ClientDisconnect
from transformers import AutoTokenizer

from offload.cli.main import build_parser
from offload.server import inputs
from offload.server.protocol import APIError

MESSAGES = [{"role": "user", "content": "t3"}]
NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """What `chat_ids` reads of an LLM: its tokenizer and its model's vocabulary."""
    tokenizer = AutoTokenizer.from_pretrained(chat_checkpoint(tmp_path_factory.mktemp("tiny")))
    model = SimpleNamespace(
        config=SimpleNamespace(vocab_size=len(tokenizer)), get_input_embeddings=lambda: None
    )
    return SimpleNamespace(tokenizer=tokenizer, model=model)


def test_the_flag_is_off_by_default():
    assert build_parser().parse_args(["serve"]).trust_request_chat_template is False


@pytest.mark.parametrize(
    "body", [{"chat_template": "{{ 1 }}"}, {"chat_template_kwargs": {"chat_template": "x"}}]
)
def test_a_request_template_is_refused_unless_trusted(llm, body):
    with pytest.raises(APIError) as caught:
        inputs.chat_ids(llm, body, MESSAGES, trusted=False)
    assert caught.value.status == 400 and caught.value.param == "chat_template"
    assert "--trust-request-chat-template is not set" in caught.value.message


def test_without_one_the_models_template_renders(llm):
    text, ids = inputs.chat_ids(llm, {}, MESSAGES, trusted=False)
    assert text == "t3 " and ids == llm.tokenizer("t3 ", add_special_tokens=False).input_ids


def test_a_trusted_template_that_loops_is_stopped_at_the_limit(llm, monkeypatch):
    monkeypatch.setattr(inputs, "MAX_RENDER_S", 0.3)
    started = time.monotonic()
    with pytest.raises(APIError) as caught:
        inputs.chat_ids(llm, {"chat_template": NESTED}, MESSAGES, trusted=True)
    assert time.monotonic() - started < 2.0
    assert caught.value.status == 400 and "took more than 0.3 s" in caught.value.message
    assert inputs.chat_ids(llm, {"chat_template": "{{ 'x' }}"}, MESSAGES, trusted=True)[0] == "x"


@pytest.mark.parametrize(
    ("template", "why"),
    [("{{ 'x' * 10**14 }}", "ran out of memory"),
     ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed too deeply")],
)  # fmt: skip
def test_a_trusted_template_that_exhausts_memory_or_the_stack_is_400(llm, template, why):
    with pytest.raises(APIError) as caught:
        inputs.chat_ids(llm, {"chat_template": template}, MESSAGES, trusted=True)
    assert caught.value.status == 400 and caught.value.message == f"the chat template {why}"


@pytest.mark.parametrize(
    ("raw", "where"),
    [(b'{"prompt": "a\\ud800"}', "prompt"), (b'{"stop": ["ok", "\\udc00"]}', "stop[1]"),
     (b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages[0].content"),
     (b'{"logit_bias": {"\\ud800": 1}}', "logit_bias")],
)  # fmt: skip
def test_a_lone_surrogate_anywhere_is_400_naming_the_field(raw, where):
    with pytest.raises(APIError) as caught:
        inputs._parsed(raw)
    assert caught.value.status == 400 and caught.value.param == where.split("[")[0]
    assert caught.value.message.startswith(f"{where} is not valid text: a lone surrogate")


def test_json_nested_too_deeply_is_400():
    with pytest.raises(APIError, match="nested too deeply"):
        inputs._parsed(b"[" * 100_000 + b"]" * 100_000)
    assert inputs._parsed(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001f600"}


def _request(chunks, headers=None):
    async def stream():
        for chunk in chunks:
            if isinstance(chunk, BaseException):
                raise chunk
            yield chunk

    return SimpleNamespace(headers=headers or {}, stream=stream)


@pytest.mark.parametrize(
    ("chunks", "headers", "status"),
    [([b"{}"], {"content-length": "11"}, 413), ([b"{", b'"a": 1}'], {}, 200),
     ([b"{" * 6, b"}" * 6], {}, 413), ([b"{", ClientDisconnect()], {}, 499)],
)  # fmt: skip
def test_a_body_is_read_within_its_limit_or_refused(chunks, headers, status):
    try:
        body = asyncio.run(inputs.json_body(_request(chunks, headers), max_bytes=10))
    except APIError as error:
        assert error.status == status, error.message
        return
    assert status == 200 and body == {"a": 1}
