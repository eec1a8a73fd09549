"""`offload serve` against what a careless or hostile client sends (issue 48's red team):
a client that leaves a non-streamed request, output beyond the context, its own chat
template, a body too large, text no tokenizer takes; and the latency metrics counted per
request. Each answer is a 400 (or 413) naming the cause, and the server goes on."""

import http.client as http_client
import json
import socket
import threading
import time

import pytest
from http_server import KEY, Server, chat_checkpoint, http

MAX_REQUEST_BYTES = 65536
HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
# A template whose loops would run 10^10 times (Jinja's sandbox caps one range at 10^5).
LOOPING = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return chat_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def server(checkpoint):
    # (trusting request templates: one server start less; tests/server/test_inputs.py
    # checks that they are refused without the flag)
    running = Server(checkpoint, "--api-key", KEY, "--max-num-seqs", "4", "--enforce-eager",
                     "--trust-request-chat-template",
                     "--max-request-bytes", str(MAX_REQUEST_BYTES))  # fmt: skip
    yield running
    running.stop()


def _post(server, path: str, body, headers=HEADERS) -> tuple[int, dict]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, text = http(server.url + path, raw, headers)
    return status, json.loads(text) if text else {}


def _error(server, path: str, body, status: int = 400) -> dict:
    got, answer = _post(server, path, body)
    assert got == status, answer
    return answer["error"]


def _metric(server, name: str) -> float:
    for line in http(server.url + "/metrics")[1].splitlines():
        if line.startswith(name + "{"):
            return float(line.split()[-1])
    raise AssertionError(f"no {name}")


def _wait_for(condition, timeout_s: float) -> float:
    """Seconds until `condition()` held (polled every 20 ms); fails after `timeout_s`."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, "timed out"
        time.sleep(0.02)
    return time.monotonic() - started


def _leaving_client(server, stream: bool = False) -> socket.socket:
    """A socket that sent a long completion request (and reads nothing)."""
    body = json.dumps({"prompt": "t3", "max_tokens": 1500, "temperature": 0,
                       "ignore_eos": True, "stream": stream}).encode()  # fmt: skip
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
    client = socket.create_connection(("127.0.0.1", server.port))
    client.sendall(head.encode() + body)
    return client


def test_a_non_streamed_request_whose_client_left_is_cancelled_at_once(server):
    with _leaving_client(server):
        _wait_for(lambda: _metric(server, "vllm:num_requests_running") == 1, 30)
    # (the old server looked for a disconnect only after 1 s without output: never here)
    assert _wait_for(lambda: _metric(server, "vllm:num_requests_running") == 0, 5) < 1.0
    assert _post(server, "/v1/completions", {"prompt": "t3", "max_tokens": 2})[0] == 200


def test_requests_waiting_in_line_whose_clients_left_are_dropped(server):
    """The 4 rows busy: a streamed and a whole request wait; their clients leave, then
    the running ones'."""
    running = [_leaving_client(server) for _ in range(4)]
    try:
        _wait_for(lambda: _metric(server, "vllm:num_requests_running") == 4, 30)
        waiting = [_leaving_client(server, stream=True), _leaving_client(server)]
        _wait_for(lambda: _metric(server, "vllm:num_requests_waiting") == 2, 30)
        for client in waiting:
            client.close()
        assert _wait_for(lambda: _metric(server, "vllm:num_requests_waiting") == 0, 5) < 1.0
    finally:
        for client in running:
            client.close()
    assert _wait_for(lambda: _metric(server, "vllm:num_requests_running") == 0, 5) < 1.0


def test_max_tokens_beyond_the_context_is_400_with_the_numbers(server):
    context = json.loads(http(server.url + "/v1/models", headers=HEADERS)[1])["data"][0]
    limit = context["max_model_len"]
    body = {"prompt": [5, 6, 7], "max_tokens": limit}
    error = _error(server, "/v1/completions", body)
    assert error["param"] == "max_tokens"
    assert f"is too large: {limit}" in error["message"]
    assert f"({limit} > {limit} - 3)" in error["message"]
    assert _post(server, "/v1/completions", {**body, "max_tokens": limit - 3})[0] == 200
    chat = {"messages": [{"role": "user", "content": "t3"}], "max_completion_tokens": limit}
    assert _error(server, "/v1/chat/completions", chat)["param"] == "max_tokens"


def test_a_body_beyond_max_request_bytes_is_413_also_chunked(server):
    big = {"prompt": "t3 " * MAX_REQUEST_BYTES, "max_tokens": 1}
    error = _error(server, "/v1/completions", big, status=413)
    assert f"larger than {MAX_REQUEST_BYTES} bytes" in error["message"]
    connection = http_client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    chunks = (b"x" * 8192 for _ in range(MAX_REQUEST_BYTES // 8192 + 2))  # (no length sent)
    connection.request("POST", "/v1/completions", chunks, HEADERS, encode_chunked=True)
    assert connection.getresponse().status == 413
    connection.close()


def test_a_lone_surrogate_is_400_naming_the_field(server):
    raw = b'{"prompt": "t3 \\ud800", "max_tokens": 1}'  # (JSON's escape: valid JSON)
    error = _error(server, "/v1/completions", raw)
    assert error["param"] == "prompt" and "lone surrogate" in error["message"]
    raw = b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 1}'
    assert _error(server, "/v1/chat/completions", raw)["param"] == "messages"


@pytest.mark.parametrize("text", [5, ["t3"]])
def test_a_content_part_whose_text_is_no_string_is_400(server, text):
    content = [{"type": "text", "text": text}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
    assert "must be a string" in _error(server, "/v1/chat/completions", body)["message"]


def test_a_key_in_another_encoding_is_401_not_500(server):
    headers = {**HEADERS, "Authorization": f"Bearer {KEY}\xe9"}  # (sent as latin-1)
    assert _post(server, "/v1/completions", {"prompt": "t3"}, headers)[0] == 401


def test_latency_histograms_count_each_request_of_a_call(server):
    ttft = _metric(server, "vllm:time_to_first_token_seconds_count")
    itl = _metric(server, "vllm:inter_token_latency_seconds_count")
    body = {"prompt": ["t3 t4", "t5"], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert _post(server, "/v1/completions", body)[0] == 200
    assert _metric(server, "vllm:time_to_first_token_seconds_count") == ttft + 2
    assert _metric(server, "vllm:inter_token_latency_seconds_count") == itl + 2 * 3


def test_offloading_totals_are_counters(server):
    text = http(server.url + "/metrics")[1]
    for name in ("weight_bytes_copied", "disk_bytes_read", "kv_bytes_moved", "stall_seconds",
                 "forwards"):  # fmt: skip
        assert f"# TYPE offload:{name}_total counter" in text  # (a gauge's type before)
        assert f"offload:{name}_total{{" in text
    gauges = [line for line in text.splitlines() if line.endswith(" gauge")]
    assert not [line for line in gauges if "_total" in line], gauges


def test_a_trusted_looping_template_is_stopped_and_health_answers_meanwhile(server):
    body = {"messages": [{"role": "user", "content": "t3"}], "chat_template": LOOPING}
    answer = {}
    sender = threading.Thread(
        target=lambda: answer.update(status=_post(server, "/v1/chat/completions", body))
    )
    sender.start()
    slowest_s = 0.0
    while sender.is_alive():
        started = time.monotonic()
        assert http(server.url + "/health")[0] == 200
        slowest_s = max(slowest_s, time.monotonic() - started)
        time.sleep(0.05)
    status, error = answer["status"]
    assert status == 400 and "took more than 2 s" in error["error"]["message"]
    assert slowest_s < 1.0
    ok = {"messages": [{"role": "user", "content": "t3"}], "max_tokens": 2,
          "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}  # fmt: skip
    assert _post(server, "/v1/chat/completions", ok)[0] == 200
