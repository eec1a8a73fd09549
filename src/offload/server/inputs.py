"""A request's body read within a size limit and parsed, its prompt rendered and tokenized:
in a worker thread, so that no request holds up the event loop (`/health` answers while a
large prompt is tokenized), and a chat template rendered under a time limit."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from offload.errors import ConfigError
from offload.llm.chat import chat_token_ids
from offload.llm.checks import check_token_ids, vocab_limit
from offload.server import protocol
from offload.server.protocol import APIError
from offload.server.tools import template_messages

MAX_RENDER_S = 2.0  # a chat template's rendering at most (a request's own, or the model's)
# Where the server refuses a request's own template (vLLM's words and flag).
UNTRUSTED_TEMPLATE = (
    "chat_template was passed with the request, but --trust-request-chat-template is not "
    "set; the request's template is refused (the model's own template is used without it)"
)


async def json_body(request: Request, max_bytes: int) -> dict[str, Any]:
    """The request's JSON object, read up to `max_bytes` (more: HTTP 413) and parsed in a
    worker thread."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():  # (a chunked body has no length to check first)
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:  # (gone before its body was sent: nobody reads the answer)
        raise APIError(499, "the client closed the connection before its body was sent") from None
    return await asyncio.to_thread(_parsed, b"".join(chunks))


def _too_large(max_bytes: int) -> APIError:
    return APIError(
        413, f"the request body is larger than {max_bytes} bytes, this server's limit "
        "(--max-request-bytes)",
    )  # fmt: skip


def _parsed(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise APIError(400, f"the request body is not valid JSON ({error})") from None
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON (nested too deeply)") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    _check_strings(body)
    return body


def _check_strings(body: dict[str, Any]) -> None:
    """Every string in the body (keys too) is text UTF-8 can hold: JSON's "\\ud800" escape
    gives a lone surrogate, which a tokenizer cannot take."""
    stack: list[tuple[str, object]] = [(key, value) for key, value in body.items()]
    for key in body:
        _check_text(key, key)
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            _check_text(where, value)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(where, key)
                stack.append((f"{where}.{key}", item))
        elif isinstance(value, list):
            stack.extend((f"{where}[{index}]", item) for index, item in enumerate(value))


def _check_text(where: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        param = where.split(".", 1)[0].split("[", 1)[0]
        raise APIError(
            400, f"{where} is not valid text: a lone surrogate "
            f"({error.object[error.start : error.end]!r}) at character {error.start}", param,
        ) from None  # fmt: skip


def prompt_ids(llm, prompts: list[str | list[int]]) -> list[list[int]]:
    """The completions prompts as token ids, checked against the vocabulary (a worker
    thread's work)."""
    ids = [llm.tokenizer(p).input_ids if isinstance(p, str) else p for p in prompts]
    try:
        check_token_ids(ids, vocab_limit(llm.model), [isinstance(p, str) for p in prompts])
    except ConfigError as error:
        raise APIError(400, str(error), "prompt") from None
    return ids


def chat_ids(
    llm, body: dict[str, Any], messages, trusted: bool, tools: list | None = None
) -> tuple[str, list[int]]:
    """The conversation through the chat template (the request's own only when `trusted`)
    with `tools` (checked: `tools.plan_of`), rendered within `MAX_RENDER_S`, and its token
    ids (a worker thread's work)."""
    template = body.get("chat_template")
    kwargs = body.get("chat_template_kwargs")
    own = template is not None or (isinstance(kwargs, dict) and "chat_template" in kwargs)
    if own and not trusted:
        raise APIError(400, UNTRUSTED_TEMPLATE, "chat_template")
    try:
        with _time_limit(MAX_RENDER_S):
            texts, ids = chat_token_ids(
                llm.tokenizer, template_messages(messages), chat_template=template,
                add_generation_prompt=body.get("add_generation_prompt", True),
                continue_final_message=body.get("continue_final_message", False),
                tools=tools, chat_template_kwargs=kwargs,
            )  # fmt: skip
        check_token_ids(ids, vocab_limit(llm.model), [True])
    except (ConfigError, ValueError, TypeError) as error:
        raise APIError(400, str(error), "messages") from None
    except (RecursionError, MemoryError) as error:  # (a trusted template's, at worst)
        why = "recursed too deeply" if isinstance(error, RecursionError) else "ran out of memory"
        raise APIError(400, f"the chat template {why}", "chat_template") from None
    return texts[0], ids[0]


def tokenized(llm, body: dict[str, Any], trusted: bool) -> dict[str, Any]:
    """`/tokenize` (vLLM's): a `prompt`, or chat `messages` through the template; the token
    ids, their count, and with `return_token_strs` each token's string (a worker thread's
    work)."""
    if "messages" in body:
        messages = protocol.messages_of(body)
        text, ids = chat_ids(llm, body, messages, trusted, body.get("tools"))
        if body.get("add_special_tokens", False):  # (else the template's own specials only)
            ids = llm.tokenizer(text, add_special_tokens=True).input_ids
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise APIError(400, "'prompt' (a string) or 'messages' is required", "prompt")
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise APIError(400, "'add_special_tokens' must be true or false", "add_special_tokens")
        ids = llm.tokenizer(prompt, add_special_tokens=special).input_ids
    strings = llm.tokenizer.convert_ids_to_tokens(ids) if body.get("return_token_strs") else None
    return {"count": len(ids), "tokens": ids, "token_strs": strings}


def detokenized(llm, body: dict[str, Any]) -> str:
    """`/detokenize` (vLLM's): the text of `tokens`, ids of this model's vocabulary."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise APIError(400, "'tokens' must be a list of token ids (integers)", "tokens")
    try:
        check_token_ids([tokens], vocab_limit(llm.model), [False])
    except ConfigError as error:
        raise APIError(400, str(error), "tokens") from None
    return llm.tokenizer.decode(tokens)


class _TooSlow(ValueError):
    """A template still rendering at its time limit."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Templates (Jinja compiles each to Python code named "<template>") run in this thread
    for at most `seconds`: a line past the deadline raises `_TooSlow` in the template."""
    deadline = time.monotonic() + seconds

    def each_line(frame, event, arg):
        if time.monotonic() > deadline:
            raise _TooSlow(f"rendering took more than {seconds:g} s, the limit")
        return each_line

    def each_call(frame, event, arg):  # (only a template's own frames are traced by line)
        return each_line if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(each_call)
    try:
        yield
    finally:
        sys.settrace(previous)
