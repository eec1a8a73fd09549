"""The one OpenAI server in front of data-parallel replicas (`replicas.py`): each request
goes, as the client sent it, to the replica with the fewest in flight, and its answer
(streamed or whole) comes back as the replica wrote it; `/health` and `/metrics` speak
for all of them."""

from __future__ import annotations

import http.client
from collections.abc import Iterator
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families
from starlette.concurrency import run_in_threadpool

from offload.errors import OffloadError
from offload.server.protocol import APIError
from offload.server.replicas import Replica, Replicas

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "host", "content-length"}
_CHUNK = 64 * 1024


def front_app(replicas: Replicas, version: str) -> FastAPI:
    app = FastAPI(title="offload", version=version)

    @app.get("/health")
    async def health() -> Response:
        living = [r for r in replicas.replicas if r.alive]
        if not living:
            error = APIError(503, "every replica stopped")
            return JSONResponse(error.body(), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await run_in_threadpool(combined_metrics, replicas)
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Response:
        body = await request.body()
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        tried: set[int] = set()
        while True:  # (a replica that cannot be reached never had the request: the next)
            try:
                replica = replicas.pick(avoid=tried)
            except OffloadError as error:
                return JSONResponse(APIError(503, str(error)).body(), status_code=503)
            try:
                answer = await run_in_threadpool(
                    _open, replica, request.method, target, body, headers
                )
                break
            except OSError:
                replicas.done(replica)
                tried.add(replica.index)
        kept = {k: v for k, v in answer.getheaders() if k.lower() not in _HOP_BY_HOP}
        return StreamingResponse(
            _relay(answer, lambda: replicas.done(replica)),
            status_code=answer.status,
            headers=kept,
        )

    return app


def _open(replica: Replica, method: str, target: str, body: bytes, headers: dict):
    address = urlsplit(replica.url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=None)
    connection.request(method, target, body=body or None, headers=headers)
    return connection.getresponse()


def _relay(answer: http.client.HTTPResponse, done) -> Iterator[bytes]:
    """The replica's answer as it comes (a stream's events at once); the client gone, the
    connection closes, and the replica cancels the request."""
    try:
        while chunk := answer.read1(_CHUNK):
            yield chunk
    finally:
        answer.close()
        done()


def combined_metrics(replicas: Replicas) -> str:
    """Every living replica's /metrics series labelled `replica="i"`, and each series
    summed over them without the label."""
    families: dict[str, tuple[str, str]] = {}  # name -> (type, help)
    samples: dict[str, list[str]] = {}
    sums: dict[tuple[str, str, str], float] = {}  # (family, sample, labels) -> sum
    for replica in replicas.replicas:
        if not replica.alive:
            continue
        try:
            text = _get(replica, "/metrics")
        except OSError:
            continue
        for family in text_string_to_metric_families(text):
            families.setdefault(family.name, (family.type, family.documentation))
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                mine = ",".join(filter(None, [labels, f'replica="{replica.index}"']))
                samples.setdefault(family.name, []).append(
                    f"{sample.name}{{{mine}}} {sample.value}"
                )
                if not sample.name.endswith("_created"):  # (a time: not summed)
                    key = (family.name, sample.name, labels)
                    sums[key] = sums.get(key, 0.0) + sample.value
    lines = []
    for name, (kind, documentation) in families.items():
        shown = f"{name}_total" if kind == "counter" else name  # (as the text format names it)
        lines += [f"# HELP {shown} {documentation}", f"# TYPE {shown} {kind}"]
        lines += samples.get(name, [])
        lines += [
            f"{sample}{{{labels}}} {value}" if labels else f"{sample} {value}"
            for (family, sample, labels), value in sums.items()
            if family == name
        ]
    return "\n".join(lines) + "\n"


def _get(replica: Replica, path: str) -> str:
    address = urlsplit(replica.url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=10)
    try:
        connection.request("GET", path)
        return connection.getresponse().read().decode()
    finally:
        connection.close()
