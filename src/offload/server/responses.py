"""The bodies `offload serve` answers with: a call's requests gathered into one completion
or chat object, or streamed as server-sent events (text deltas as they settle, then the
finish reason, the usage when asked, and [DONE]), with the latency metrics observed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from offload.engine.sequences import RequestOutput
from offload.errors import ConfigError, OffloadError
from offload.llm.streaming import settled
from offload.server import protocol
from offload.server.metrics import ServerMetrics
from offload.server.protocol import APIError
from offload.server.tool_stream import ToolStream
from offload.server.tools import ToolPlan


@dataclass
class Call:
    """One HTTP call's requests in the engine (a completions call may hold several
    prompts) and the outputs they send back to the event loop."""

    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    requests: list = field(default_factory=list)
    arrival_s: float = field(default_factory=time.monotonic)


@dataclass
class Shape:
    """What the responses of one call share."""

    kind: str  # "text_completion" or "chat.completion"
    id: str
    model: str
    request: protocol.Request
    created: int = field(default_factory=protocol.now)
    decode: Callable[[list[int]], str] = str  # token ids to text (an echoed prompt of ids)
    tools: ToolPlan | None = None  # (chat) the answer's text read back into tool calls

    @property
    def is_chat(self) -> bool:
        return self.kind == "chat.completion"

    def envelope(self, chunk: bool = False) -> dict[str, Any]:
        kind = self.kind + ".chunk" if chunk and self.is_chat else self.kind
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


class _Progress:
    """The token timings of a call's requests, each request on its own (as vLLM observes
    them): its time to first token once, then the time between its steps that added one."""

    def __init__(self, call: Call, metrics: ServerMetrics):
        self._call, self._metrics = call, metrics
        self._tokens: dict[int, int] = {}  # by request index: tokens seen
        self._last_s: dict[int, float] = {}  # by request index: when its last one came

    def saw(self, index: int, output: RequestOutput) -> None:
        tokens = sum(len(c.token_ids) for c in output.outputs)
        if tokens <= self._tokens.get(index, 0):
            return
        moment = time.monotonic()
        if index not in self._last_s:
            self._metrics.time_to_first_token.observe(moment - self._call.arrival_s)
        else:
            self._metrics.inter_token_latency.observe(moment - self._last_s[index])
        self._tokens[index], self._last_s[index] = tokens, moment


class _ClientGone(Exception):
    """The client closed its connection before the answer."""


async def _next(call: Call) -> tuple[int, RequestOutput]:
    index, item = await call.outputs.get()
    if isinstance(item, BaseException):
        raise item
    return index, item


async def _watch(request: Request, call: Call, cancel) -> None:
    """Wait for the client's disconnect (the server's next message once the body is read),
    then cancel the call's requests at once (the engine frees their rows at its next step)
    and wake whoever waits on the outputs."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    cancel(call)
    call.outputs.put_nowait((-1, _ClientGone()))


@contextlib.asynccontextmanager
async def _watching(request: Request | None, call: Call, cancel):
    watcher = asyncio.create_task(_watch(request, call, cancel)) if request else None
    try:
        yield
    finally:
        if watcher is not None:
            watcher.cancel()


def _choice(
    shape: Shape, index: int, completion, text: str, new_tokens, reason, output=None
) -> dict:
    """One choice of `completion`: `text` and `new_tokens` (what is sent now); `output`
    (its request's) where the prompt comes first: echoed, its prompt logprobs given."""
    params = shape.request.params
    echoed = output is not None and shape.request.echo
    logprobs = None
    if params.logprobs is not None:
        start = len(completion.token_ids) - len(new_tokens)
        entries, tokens = completion.logprobs[start:], list(new_tokens)
        if shape.is_chat:
            logprobs = protocol.chat_logprobs(entries, tokens, params.logprobs)
        else:
            if echoed:
                entries = [*output.prompt_logprobs, *entries]
                tokens = [*output.prompt_token_ids, *tokens]
            decoded = lambda token: shape.decode([token])  # noqa: E731
            logprobs = protocol.completion_logprobs(entries, tokens, 0, decoded)
    if echoed:
        text = _prompt_text(shape, output) + text
    if shape.is_chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
    choice = {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": reason,
        "stop_reason": completion.stop_reason if reason else None,
    }
    if output is not None and params.prompt_logprobs is not None:
        choice["prompt_logprobs"] = protocol.prompt_logprobs_of(output.prompt_logprobs)
    return choice


def _prompt_text(shape: Shape, output: RequestOutput) -> str:
    return output.prompt if output.prompt is not None else shape.decode(output.prompt_token_ids)


async def whole(call: Call, shape: Shape, request: Request, metrics, cancel) -> dict:
    """Wait for every request of the call (cancelling them if the client leaves)."""
    finals: dict[int, RequestOutput] = {}
    progress = _Progress(call, metrics)
    try:
        async with _watching(request, call, cancel):
            while len(finals) < len(call.requests):
                index, output = await _next(call)
                progress.saw(index, output)
                if output.finished:
                    finals[index] = output
    except _ClientGone:
        return Response(status_code=499)  # (nobody reads it: nginx's "client closed")
    except (OffloadError, OSError, RuntimeError) as error:
        cancel(call)
        metrics.request_failure.inc()
        raise APIError(500, f"the request failed: {error}") from None
    choices, prompt_tokens, completion_tokens = [], 0, 0
    n = shape.request.params.n
    for index in sorted(finals):
        output = finals[index]
        prompt_tokens += len(output.prompt_token_ids)
        for number, completion in enumerate(output.outputs):
            completion_tokens += len(completion.token_ids)
            choice = _choice(
                shape, index * n + number, completion, completion.text,
                completion.token_ids, completion.finish_reason, output,
            )  # fmt: skip
            if shape.is_chat:
                text, reason = choice.pop("text"), choice["finish_reason"]
                if shape.tools is None:
                    choice["message"] = {"role": "assistant", "content": text}
                else:
                    choice["message"], choice["finish_reason"] = shape.tools.message(text, reason)
            choices.append(choice)
    _finished(metrics, call, prompt_tokens, completion_tokens, len(finals))
    body = {**shape.envelope(), "choices": choices}
    if shape.is_chat and shape.request.params.prompt_logprobs is not None:  # (vLLM's place)
        body["prompt_logprobs"] = protocol.prompt_logprobs_of(finals[0].prompt_logprobs)
    return {**body, "usage": protocol.usage(prompt_tokens, completion_tokens)}


def _finished(metrics, call: Call, prompt_tokens: int, completion_tokens: int, count: int):
    metrics.prompt_tokens.inc(prompt_tokens)
    metrics.generation_tokens.inc(completion_tokens)
    metrics.request_success.inc(count)
    metrics.e2e_latency.observe(time.monotonic() - call.arrival_s)


async def stream(
    call: Call, shape: Shape, metrics, cancel, request: Request | None = None
) -> AsyncIterator[str]:
    """Server-sent events: text deltas as they settle, the finish reason, then the usage
    (when asked for) and [DONE]. An error ends the stream with OpenAI's error object. The
    client's disconnect (`request`'s) cancels the call at once, also while it waits."""
    params = shape.request.params
    n = params.n
    sent_text: dict[int, str] = {}
    sent_tokens: dict[int, int] = {}
    tool_streams: dict[int, ToolStream] = {}  # by choice (with tools)
    finals: dict[int, RequestOutput] = {}
    progress = _Progress(call, metrics)
    try:
        async with _watching(request, call, cancel):
            if shape.is_chat:
                first = {"index": 0, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}  # fmt: skip
                yield _event({**shape.envelope(chunk=True), "choices": [first]})
            while len(finals) < len(call.requests):
                index, output = await _next(call)
                progress.saw(index, output)
                for number, completion in enumerate(output.outputs):
                    choice = index * n + number
                    sent = (sent_text, sent_tokens, tool_streams)
                    event = _delta(shape, choice, completion, sent, output)
                    if event is not None:
                        yield event
                if output.finished:
                    finals[index] = output
        prompt_tokens = sum(len(o.prompt_token_ids) for o in finals.values())
        completion_tokens = sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
        _finished(metrics, call, prompt_tokens, completion_tokens, len(finals))
        if shape.request.include_usage:
            usage = protocol.usage(prompt_tokens, completion_tokens)
            yield _event({**shape.envelope(chunk=True), "choices": [], "usage": usage})
    except _ClientGone:
        return  # (cancelled already; nobody reads more)
    except (OffloadError, OSError, RuntimeError, ConfigError) as error:
        cancel(call)
        metrics.request_failure.inc()
        yield _event(APIError(500, f"the request failed: {error}").body())
    finally:
        if len(finals) < len(call.requests):
            cancel(call)  # the client left (or the stream failed): free the rows
    yield "data: [DONE]\n\n"


def _delta(shape: Shape, choice: int, completion, sent: tuple[dict, dict, dict], output):
    """The event of what `completion` (choice number `choice`) has that was not sent yet
    (text settled past any stop string), or None; a choice's first event carries its
    echoed prompt and its prompt logprobs (`output`: its request's). `sent`: by choice,
    the text and the count of tokens sent, and (with tools) the choice's `ToolStream`."""
    params = shape.request.params
    sent_text, sent_tokens, tool_streams = sent
    before = sent_text.get(choice, "")
    if before is None:
        return None  # finished already
    reason = completion.finish_reason
    text = completion.text if reason else settled(completion.text, params.stop_strings)
    delta = text[len(before) :] if text.startswith(before) else ""
    new_tokens = completion.token_ids[sent_tokens.get(choice, 0) :]
    if not (delta or new_tokens) and reason is None:
        return None
    first = choice not in sent_tokens
    sent_text[choice] = None if reason else text
    sent_tokens[choice] = len(completion.token_ids)
    body = _choice(shape, choice, completion, delta, new_tokens, reason, output if first else None)
    if shape.is_chat and shape.tools is not None:
        body.pop("text")
        tools = tool_streams.setdefault(choice, ToolStream(shape.tools))
        body["delta"] = tools.delta(text, finished=reason is not None)
        body["finish_reason"] = shape.tools.reason(reason, tools.called)
        if not body["delta"] and body["logprobs"] is None and reason is None:
            return None  # (text held back: it may begin a call)
    elif shape.is_chat:
        body["delta"] = {"content": body.pop("text")} if delta or not reason else {}
    return _event({**shape.envelope(chunk=True), "choices": [body]})


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


def sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream")
