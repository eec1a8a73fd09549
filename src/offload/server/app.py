"""`offload serve`'s HTTP side: vLLM's OpenAI-compatible endpoints over an `LLM`'s
continuous-batching engine (FastAPI; uvicorn runs it)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from offload.engine.sequences import RequestOutput
from offload.errors import ConfigError, OffloadError
from offload.llm.chat import chat_token_ids
from offload.llm.checks import check_token_ids, vocab_limit
from offload.llm.streaming import settled
from offload.server import protocol
from offload.server.metrics import ServerMetrics
from offload.server.protocol import APIError

_logger = logging.getLogger("offload")


@dataclass(frozen=True)
class ServeSettings:
    model_name: str
    api_key: str | None = None
    max_waiting: int = 256  # requests waiting beyond this are answered 503 at once
    version: str = "unknown"


@dataclass
class _Call:
    """One HTTP call's requests in the engine (a completions call may hold several
    prompts) and the outputs they send back to the event loop."""

    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    requests: list = field(default_factory=list)
    arrival_s: float = field(default_factory=time.monotonic)


def make_app(llm, settings: ServeSettings) -> FastAPI:
    """The server of `llm` (its continuous-batching engine made now)."""
    serving = llm.serving()
    engine = serving.engine
    metrics = ServerMetrics(settings.model_name, engine, llm.transfer_stats)
    app = FastAPI(title="offload", version=settings.version)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        _logger.exception("request failed")
        return JSONResponse(APIError(500, f"internal error: {error}").body(), status_code=500)

    @app.middleware("http")
    async def _authorize(request: Request, call_next):
        key = request.headers.get("authorization", "")
        if (
            settings.api_key
            and request.url.path.startswith("/v1")
            and key != f"Bearer {settings.api_key}"
        ):
            error = APIError(401, "a valid API key is needed (Authorization: Bearer KEY)")
            return JSONResponse(error.body(), status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        if not serving.healthy():
            error = APIError(503, f"the model failed its last step: {engine.last_error}")
            return JSONResponse(error.body(), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": settings.version}

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = await run_in_threadpool(metrics.render)  # (reads the LLM's counters)
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": settings.model_name,
            "object": "model",
            "created": protocol.now(),
            "owned_by": "offload",
            "max_model_len": serving.max_model_len,
        }
        return {"object": "list", "data": [card]}

    def check(request: protocol.Request, count: int) -> None:
        if request.model is not None and request.model != settings.model_name:
            raise APIError(
                404, f"the model {request.model!r} does not exist; this server serves "
                f"{settings.model_name!r}", "model", kind="model_not_found",
            )  # fmt: skip
        if engine.num_waiting + count > settings.max_waiting:
            raise APIError(
                503, f"the server is busy ({engine.num_waiting} requests waiting); try again later"
            )

    def submit(call: _Call, prompt, ids, params, index: int) -> None:
        loop = asyncio.get_running_loop()

        def emit(item, index=index) -> None:
            loop.call_soon_threadsafe(call.outputs.put_nowait, (index, item))

        try:
            call.requests.append(serving.submit(prompt, ids, params, emit))
        except (ConfigError, ValueError) as error:
            cancel(call)
            raise protocol.bad_request(error) from None
        except OffloadError as error:
            cancel(call)
            raise APIError(503, str(error)) from None

    def cancel(call: _Call) -> None:
        for request in call.requests:
            engine.cancel(request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json(request)
        parsed = protocol.sampling_params(body, chat=False)
        prompts = protocol.prompts_of(body)
        check(parsed, len(prompts))
        encoded = [isinstance(p, str) for p in prompts]
        ids = [llm.tokenizer(p).input_ids if isinstance(p, str) else p for p in prompts]
        try:
            check_token_ids(ids, vocab_limit(llm.model), encoded)
        except ConfigError as error:
            raise APIError(400, str(error), "prompt") from None
        call = _Call()
        for index, (prompt, prompt_ids) in enumerate(zip(prompts, ids, strict=True)):
            text = prompt if isinstance(prompt, str) else None
            submit(call, text, prompt_ids, parsed.params, index)
        shape = _Shape("text_completion", protocol.new_id("cmpl"), settings.model_name, parsed)
        if parsed.stream:
            return _sse(_stream(call, shape, metrics, cancel))
        return await _whole(call, shape, request, metrics, cancel)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _json(request)
        parsed = protocol.sampling_params(body, chat=True)
        messages = protocol.messages_of(body)
        check(parsed, 1)
        try:
            texts, ids = chat_token_ids(
                llm.tokenizer,
                messages,
                chat_template=body.get("chat_template"),
                add_generation_prompt=body.get("add_generation_prompt", True),
                continue_final_message=body.get("continue_final_message", False),
                tools=body.get("tools"),
                chat_template_kwargs=body.get("chat_template_kwargs"),
            )
            check_token_ids(ids, vocab_limit(llm.model), [True])
        except (ConfigError, ValueError, TypeError) as error:
            raise APIError(400, str(error), "messages") from None
        call = _Call()
        submit(call, texts[0], ids[0], parsed.params, 0)
        shape = _Shape("chat.completion", protocol.new_id("chatcmpl"), settings.model_name, parsed)
        if parsed.stream:
            return _sse(_stream(call, shape, metrics, cancel))
        return await _whole(call, shape, request, metrics, cancel)

    @app.on_event("shutdown")
    def _close() -> None:
        serving.close()

    return app


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise APIError(400, f"the request body is not valid JSON ({error})") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


@dataclass
class _Shape:
    """What the responses of one call share."""

    kind: str  # "text_completion" or "chat.completion"
    id: str
    model: str
    request: protocol.Request
    created: int = field(default_factory=protocol.now)

    @property
    def is_chat(self) -> bool:
        return self.kind == "chat.completion"

    def envelope(self, chunk: bool = False) -> dict[str, Any]:
        kind = self.kind + ".chunk" if chunk and self.is_chat else self.kind
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


class _Progress:
    """A call's token timings, for the latency metrics."""

    def __init__(self, call: _Call, metrics: ServerMetrics):
        self._call, self._metrics = call, metrics
        self._tokens = 0
        self._last_s: float | None = None

    def saw(self, output: RequestOutput) -> None:
        tokens = sum(len(c.token_ids) for c in output.outputs)
        if tokens <= self._tokens:
            return
        moment = time.monotonic()
        if self._last_s is None:
            self._metrics.time_to_first_token.observe(moment - self._call.arrival_s)
        else:
            self._metrics.inter_token_latency.observe(moment - self._last_s)
        self._tokens, self._last_s = tokens, moment


async def _next(call: _Call) -> tuple[int, RequestOutput]:
    index, item = await call.outputs.get()
    if isinstance(item, BaseException):
        raise item
    return index, item


def _choice(shape: _Shape, index: int, completion, text: str, new_tokens, reason) -> dict:
    params = shape.request.params
    logprobs = None
    if params.logprobs is not None:
        start = len(completion.token_ids) - len(new_tokens)
        entries = completion.logprobs[start:]
        if shape.is_chat:
            logprobs = protocol.chat_logprobs(entries, new_tokens, params.logprobs)
        else:
            logprobs = protocol.completion_logprobs(entries, new_tokens, 0)
    if shape.is_chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": reason,
        "stop_reason": completion.stop_reason if reason else None,
    }


async def _whole(call: _Call, shape: _Shape, request: Request, metrics, cancel) -> dict:
    """Wait for every request of the call (cancelling them if the client leaves)."""
    finals: dict[int, RequestOutput] = {}
    progress = _Progress(call, metrics)
    try:
        while len(finals) < len(call.requests):
            try:
                index, output = await asyncio.wait_for(_next(call), timeout=1.0)
            except TimeoutError:
                if await request.is_disconnected():
                    cancel(call)
                    return Response(status_code=499)
                continue
            progress.saw(output)
            if output.finished:
                finals[index] = output
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
                completion.token_ids, completion.finish_reason,
            )  # fmt: skip
            if shape.is_chat:
                text = choice.pop("text")
                choice["message"] = {"role": "assistant", "content": text}
            choices.append(choice)
    _finished(metrics, call, prompt_tokens, completion_tokens, len(finals))
    return {
        **shape.envelope(),
        "choices": choices,
        "usage": protocol.usage(prompt_tokens, completion_tokens),
    }


def _finished(metrics, call: _Call, prompt_tokens: int, completion_tokens: int, count: int):
    metrics.prompt_tokens.inc(prompt_tokens)
    metrics.generation_tokens.inc(completion_tokens)
    metrics.request_success.inc(count)
    metrics.e2e_latency.observe(time.monotonic() - call.arrival_s)


async def _stream(call: _Call, shape: _Shape, metrics, cancel) -> AsyncIterator[str]:
    """Server-sent events: text deltas as they settle, the finish reason, then the usage
    (when asked for) and [DONE]. An error ends the stream with OpenAI's error object."""
    params = shape.request.params
    n = params.n
    sent_text: dict[int, str] = {}
    sent_tokens: dict[int, int] = {}
    finals: dict[int, RequestOutput] = {}
    progress = _Progress(call, metrics)
    try:
        if shape.is_chat:
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}  # fmt: skip
            yield _event({**shape.envelope(chunk=True), "choices": [first]})
        while len(finals) < len(call.requests):
            index, output = await _next(call)
            progress.saw(output)
            for number, completion in enumerate(output.outputs):
                choice = index * n + number
                before = sent_text.get(choice, "")
                if before is None:
                    continue  # finished already
                reason = completion.finish_reason
                text = completion.text if reason else settled(completion.text, params.stop_strings)
                delta = text[len(before) :] if text.startswith(before) else ""
                new_tokens = completion.token_ids[sent_tokens.get(choice, 0) :]
                if not (delta or new_tokens) and reason is None:
                    continue
                sent_text[choice] = None if reason else text
                sent_tokens[choice] = len(completion.token_ids)
                body = _choice(shape, choice, completion, delta, new_tokens, reason)
                if shape.is_chat:
                    body["delta"] = {"content": body.pop("text")} if delta or not reason else {}
                yield _event({**shape.envelope(chunk=True), "choices": [body]})
            if output.finished:
                finals[index] = output
        prompt_tokens = sum(len(o.prompt_token_ids) for o in finals.values())
        completion_tokens = sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
        _finished(metrics, call, prompt_tokens, completion_tokens, len(finals))
        if shape.request.include_usage:
            usage = protocol.usage(prompt_tokens, completion_tokens)
            yield _event({**shape.envelope(chunk=True), "choices": [], "usage": usage})
    except (OffloadError, OSError, RuntimeError, ConfigError) as error:
        cancel(call)
        metrics.request_failure.inc()
        yield _event(APIError(500, f"the request failed: {error}").body())
    finally:
        if len(finals) < len(call.requests):
            cancel(call)  # the client left (or the stream failed): free the rows
    yield "data: [DONE]\n\n"


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream")
