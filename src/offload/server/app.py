"""`offload serve`'s HTTP side: vLLM's OpenAI-compatible endpoints over an `LLM`'s
continuous-batching engine (FastAPI; uvicorn runs it)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from offload.errors import ConfigError, OffloadError
from offload.llm.chat import chat_token_ids
from offload.llm.checks import check_token_ids, vocab_limit
from offload.server import protocol
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


def make_app(llm, settings: ServeSettings) -> FastAPI:
    """The server of `llm` (its continuous-batching engine made now)."""
    serving = llm.serving()
    engine = serving.engine
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

    def submit(call: Call, prompt, ids, params, index: int) -> None:
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

    def cancel(call: Call) -> None:
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
        call = Call()
        for index, (prompt, prompt_ids) in enumerate(zip(prompts, ids, strict=True)):
            text = prompt if isinstance(prompt, str) else None
            submit(call, text, prompt_ids, parsed.params, index)
        shape = Shape("text_completion", protocol.new_id("cmpl"), settings.model_name, parsed)
        if parsed.stream:
            return sse(stream(call, shape, metrics, cancel))
        return await whole(call, shape, request, metrics, cancel)

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
        call = Call()
        submit(call, texts[0], ids[0], parsed.params, 0)
        shape = Shape("chat.completion", protocol.new_id("chatcmpl"), settings.model_name, parsed)
        if parsed.stream:
            return sse(stream(call, shape, metrics, cancel))
        return await whole(call, shape, request, metrics, cancel)

    return app


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise APIError(400, f"the request body is not valid JSON ({error})") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body
