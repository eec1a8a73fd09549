"""`offload serve`'s HTTP side: vLLM's OpenAI-compatible endpoints over an `LLM`'s
continuous-batching engine (FastAPI; uvicorn runs it)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from offload.config.limits import DEFAULT_MAX_REQUEST_BYTES
from offload.errors import ConfigError, OffloadError
from offload.server import protocol, tools
from offload.server.inputs import chat_ids, detokenized, json_body, prompt_ids, tokenized
from offload.server.metrics import ServerMetrics
from offload.server.protocol import APIError
from offload.server.responses import Call, Shape, sse, stream, whole

_logger = logging.getLogger("offload")


@dataclass(frozen=True)
class ServeSettings:
    model_name: str
    api_key: str | None = None
    max_waiting: int = 256  # requests waiting beyond this are answered 503 at once
    version: str = "unknown"
    trust_request_chat_template: bool = False  # else a request's own template is refused
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # a larger body is answered 413
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (needs tool_call_parser)
    tool_call_parser: str | None = None  # "hermes" or "llama3_json" (vLLM's names)
    exclude_tools_when_tool_choice_none: bool = False  # "none": the template sees no tools


def make_app(llm, settings: ServeSettings) -> FastAPI:
    """The server of `llm` (its continuous-batching engine made now)."""
    server_tools = tools.server_tools(
        settings.enable_auto_tool_choice, settings.tool_call_parser,
        settings.exclude_tools_when_tool_choice_none,
    )  # fmt: skip
    serving = llm.serving()
    engine = serving.core
    metrics = ServerMetrics(settings.model_name, engine, llm.transfer_stats)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        serving.close()  # the server stops: requests still running end with an error

    app = FastAPI(title="offload", version=settings.version, lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        _logger.exception("request failed")
        return JSONResponse(APIError(500, f"internal error: {error}").body(), status_code=500)

    if settings.api_key:
        app.add_middleware(_KeyRequired, key=settings.api_key)

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

    def check_model(model: object) -> None:
        if model is not None and model != settings.model_name:
            raise APIError(
                404, f"the model {model!r} does not exist; this server serves "
                f"{settings.model_name!r}", "model", kind="model_not_found",
            )  # fmt: skip

    def check(request: protocol.Request, count: int) -> None:
        check_model(request.model)
        if engine.num_waiting + count > settings.max_waiting:
            raise APIError(
                503, f"the server is busy ({engine.num_waiting} requests waiting); try again later"
            )

    def submit(call: Call, prompt, ids, params, index: int) -> None:
        loop = asyncio.get_running_loop()

        def emit(item, index=index) -> None:
            # (its event loop closed: the server is stopping and no one reads the output)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(call.outputs.put_nowait, (index, item))

        try:
            call.requests.append(serving.submit(prompt, ids, params, emit))
        except (ConfigError, ValueError) as error:
            cancel(call)
            raise protocol.bad_request(error) from None
        except OffloadError as error:
            cancel(call)
            raise APIError(503, str(error)) from None

    def cancel(call: Call) -> None:
        for request in call.requests:
            engine.cancel(request)

    def check_room(ids: list[int], params) -> None:
        """`max_tokens` beyond what the context leaves the prompt: 400, as vLLM answers."""
        prompt_tokens = len(serving.truncate(ids, params))
        room = serving.max_model_len - prompt_tokens
        if params.max_tokens is not None and 0 < room < params.max_tokens:
            raise APIError(
                400, f"'max_tokens' or 'max_completion_tokens' is too large: "
                f"{params.max_tokens}. This model's maximum context length is "
                f"{serving.max_model_len} tokens and your request has {prompt_tokens} input "
                f"tokens ({params.max_tokens} > {serving.max_model_len} - {prompt_tokens})",
                "max_tokens",
            )  # fmt: skip

    async def answer(request: Request, call: Call, shape: Shape):
        if shape.request.stream:
            return sse(stream(call, shape, metrics, cancel, request))
        return await whole(call, shape, request, metrics, cancel)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await json_body(request, settings.max_request_bytes)
        parsed = protocol.sampling_params(body, chat=False)
        prompts = protocol.prompts_of(body)
        check(parsed, len(prompts))
        ids = await asyncio.to_thread(prompt_ids, llm, prompts)
        for tokens in ids:
            check_room(tokens, parsed.params)
        call = Call()
        for index, (prompt, tokens) in enumerate(zip(prompts, ids, strict=True)):
            text = prompt if isinstance(prompt, str) else None
            submit(call, text, tokens, parsed.params, index)
        name = settings.model_name
        shape = Shape(
            "text_completion", protocol.new_id("cmpl"), name, parsed, decode=llm.tokenizer.decode
        )
        return await answer(request, call, shape)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await json_body(request, settings.max_request_bytes)
        parsed = protocol.sampling_params(body, chat=True)
        messages = protocol.messages_of(body)
        plan = tools.plan_of(body, server_tools)
        if plan is not None:
            plan.adjust(parsed.params)
        check(parsed, 1)
        trusted = settings.trust_request_chat_template
        given = plan.template_tools if plan is not None else None
        text, ids = await asyncio.to_thread(chat_ids, llm, body, messages, trusted, given)
        check_room(ids, parsed.params)
        call = Call()
        submit(call, text, ids, parsed.params, 0)
        reads = plan if plan is not None and plan.reads_output else None
        shape = Shape(
            "chat.completion", protocol.new_id("chatcmpl"), settings.model_name, parsed, tools=reads
        )
        return await answer(request, call, shape)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await json_body(request, settings.max_request_bytes)
        check_model(body.get("model"))
        trusted = settings.trust_request_chat_template
        answer = await asyncio.to_thread(tokenized, llm, body, trusted)
        return {**answer, "max_model_len": serving.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, str]:
        body = await json_body(request, settings.max_request_bytes)
        check_model(body.get("model"))
        return {"prompt": await asyncio.to_thread(detokenized, llm, body)}

    return app


class _KeyRequired:
    """Requests to /v1 must carry 'Authorization: Bearer KEY' (compared in constant time).
    Plain ASGI: the endpoints see the client's own messages (its disconnect at once)."""

    def __init__(self, app, key: str):
        self._app = app
        self._expected = f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                error = APIError(401, "a valid API key is needed (Authorization: Bearer KEY)")
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
        await self._app(scope, receive, send)
