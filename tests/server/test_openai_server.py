"""`offload serve` started by the test on 127.0.0.1, spoken to with the real `openai`
client (and raw HTTP for what a client library would not send)."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest
from http_server import KEY, Server, chat_checkpoint, http


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return chat_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def server(checkpoint):
    running = Server(checkpoint, "--api-key", KEY, "--max-num-seqs", "8")
    yield running
    running.stop()


def _completion(client, prompt, **kwargs):
    return client.completions.create(
        model="tiny", prompt=prompt, **{"temperature": 0, "max_tokens": 8, **kwargs}
    )


def test_completions_whole_and_streamed_agree(server):
    client = server.client()
    whole = _completion(client, "t3 t4 t5", logprobs=2)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and len(choice.logprobs.tokens) == 8
    assert whole.usage.prompt_tokens == 3 and whole.usage.completion_tokens == 8
    chunks = list(
        _completion(client, "t3 t4 t5", stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert chunks[-1].usage.completion_tokens == 8  # the usage chunk comes last
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_n_and_several_prompts(server):
    response = _completion(server.client(), ["t3 t4", "t9"], n=2, seed=3)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.choices[0].text == response.choices[1].text  # greedy: the same twice
    assert response.usage.completion_tokens == 4 * 8


def test_chat_whole_and_streamed_with_logprobs(server):
    client = server.client()
    messages = [{"role": "user", "content": "t5 t6 t7"}]
    whole = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=6, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content
    entries = whole.choices[0].logprobs.content
    assert len(entries) == 6 and all(len(e.top_logprobs) == 2 for e in entries)
    assert all(e.logprob <= 0 for e in entries)
    stream = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=6, stream=True
    )
    deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(deltas) == message.content


def test_a_stop_string_ends_the_text(server):
    client = server.client()
    full = _completion(client, "t3 t4 t5").choices[0].text
    stop = full.split()[2]
    cut = _completion(client, "t3 t4 t5", stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]


def test_models_health_version_and_metrics(server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    _completion(client, "t3")
    assert http(server.url + "/health")[0] == 200
    assert json.loads(http(server.url + "/version")[1])["version"]
    metrics = http(server.url + "/metrics")[1]
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds",
                 "vllm:generation_tokens_total", "offload:weight_bytes_copied_total",
                 "offload:forwards_total"):  # fmt: skip
        assert name in metrics
    generated = [
        line for line in metrics.splitlines() if line.startswith("vllm:generation_tokens_total")
    ]
    assert float(generated[0].split()[-1]) >= 8


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_tokens": "x"}, "max_tokens"),
     ({"n": 0}, "n"), ({"best_of": 2}, "best_of")],
)  # fmt: skip
def test_bad_parameters_are_400_naming_the_parameter(server, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().completions.create(model="tiny", prompt="t3", **kwargs)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param and caught.value.body["type"]


def test_unknown_model_missing_key_bad_json_and_a_prompt_too_long(server):
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="other", prompt="t3")
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").completions.create(model="tiny", prompt="t3")
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    status, text = http(server.url + "/v1/completions", b"{not json", headers)
    assert status == 400 and "JSON" in json.loads(text)["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        server.client().completions.create(model="tiny", prompt=[5] * 5000, max_tokens=1)
    assert http(server.url + "/health")[0] == 200  # still serving


def test_concurrent_greedy_requests_get_their_answers_alone(server):
    client = server.client()
    prompts = [f"t{i} t{i + 1} t{2 * i}" for i in range(3, 11)]
    alone = [_completion(client, p, max_tokens=12).choices[0].text for p in prompts]
    together = [None] * len(prompts)

    def ask(index):
        together[index] = _completion(client, prompts[index], max_tokens=12).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert together == alone


def test_a_shared_prompt_prefix_is_a_hit_in_metrics(server):
    """vLLM's prefix-cache counters: a prompt that begins as an earlier one (here 40
    words, two whole blocks of 16 tokens) is found held, and `/metrics` counts it."""
    client = server.client()
    before = (_gauge(server, "vllm:prefix_cache_queries_total"),
              _gauge(server, "vllm:prefix_cache_hits_total"))  # fmt: skip
    shared = " ".join(f"t{3 + i % 20}" for i in range(40))
    _completion(client, shared + " t5", max_tokens=2)
    _completion(client, shared + " t7 t9", max_tokens=2)
    queries = _gauge(server, "vllm:prefix_cache_queries_total") - before[0]
    hits = _gauge(server, "vllm:prefix_cache_hits_total") - before[1]
    assert queries >= 83 and hits >= 32
    assert 0 < _gauge(server, "vllm:gpu_prefix_cache_hit_rate") <= 1


def _gauge(server, name: str) -> float:
    for line in http(server.url + "/metrics")[1].splitlines():
        if line.startswith(name + "{"):
            return float(line.split()[-1])
    raise AssertionError(f"no {name}")


def _running(server) -> float:
    return _gauge(server, "vllm:num_requests_running")


def test_a_client_that_leaves_frees_its_request(server):
    stream = server.client().completions.create(
        model="tiny", prompt="t3", max_tokens=1500, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for count, _ in enumerate(stream):
        if count == 3:
            break
    stream.close()
    deadline = time.monotonic() + 20
    while _running(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running(server) == 0


def test_a_full_queue_answers_503_and_sigterm_ends_streams_and_exits_0(checkpoint):
    server = Server(checkpoint, "--max-num-seqs", "1", "--max-waiting-requests", "1")
    try:
        client = server.client()
        long = {
            "model": "tiny",
            "temperature": 0,
            "max_tokens": 1900,
            "extra_body": {"ignore_eos": True},
        }
        first = client.completions.create(prompt="t3", stream=True, **long)
        next(iter(first))  # running

        def wait_in_line():
            with contextlib.suppress(openai.APIError):  # ended by the SIGTERM below
                client.completions.create(prompt="t4", **long)

        threading.Thread(target=wait_in_line, daemon=True).start()
        deadline = time.monotonic() + 20
        while _gauge(server, "vllm:num_requests_waiting") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(openai.InternalServerError) as caught:  # at once, not queued
            client.completions.create(model="tiny", prompt="t5", max_tokens=1)
        assert caught.value.status_code == 503 and "busy" in str(caught.value)
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in first:  # the stream in flight ends with a clear error, not a cut
                pass
        assert server.process.wait(timeout=10) == 0
        assert time.monotonic() - started < 10
    finally:
        server.stop()
        if server.process.poll() is None:
            os.kill(server.process.pid, signal.SIGKILL)


def test_a_port_already_taken_is_one_line_and_exit_2(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "offload.cli", "serve", str(chat_checkpoint(tmp_path)),
                   "--port", str(port), "--no-progress"]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"offload: error: offload serve could not listen on 127.0.0.1:{port}"
    )
    assert "Traceback" not in done.stderr


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    status, text = http(server.url + path, json.dumps(body).encode(), headers)
    return status, json.loads(text)


def test_tokenize_and_detokenize_as_vllm_answers_them(server):
    """The ids /tokenize gives are those the server generates from: completing them gives
    the text prompt's answer, and the chat form counts the chat's prompt tokens."""
    client = server.client()
    status, answer = _post(server, "/tokenize", {"model": "tiny", "prompt": "t3 t4 t5"})
    assert status == 200 and answer["count"] == len(answer["tokens"]) == 3
    assert answer["token_strs"] is None
    card = client.models.list().data[0]
    assert answer["max_model_len"] == card.model_extra["max_model_len"]
    by_text, by_ids = _completion(client, "t3 t4 t5"), _completion(client, answer["tokens"])
    assert by_ids.choices[0].text == by_text.choices[0].text
    status, back = _post(server, "/detokenize", {"tokens": answer["tokens"]})
    assert status == 200 and back == {"prompt": "t3 t4 t5"}
    _, strings = _post(server, "/tokenize", {"prompt": "t3 t4", "return_token_strs": True})
    assert len(strings["token_strs"]) == strings["count"] == 2
    messages = [{"role": "user", "content": "t3 t4"}]
    _, chat = _post(server, "/tokenize", {"model": "tiny", "messages": messages})
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    assert chat["count"] == reply.usage.prompt_tokens >= 2


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [("/tokenize", {}, 400, "prompt"), ("/tokenize", {"prompt": 3}, 400, "prompt"),
     ("/tokenize", {"prompt": "t3", "model": "other"}, 404, "model"),
     ("/detokenize", {"tokens": "t3"}, 400, "tokens"),
     ("/detokenize", {"tokens": [10**9]}, 400, "tokens")],
)  # fmt: skip
def test_bad_tokenize_requests_name_what_was_wrong(server, path, body, status, param):
    got, answer = _post(server, path, body)
    assert got == status and answer["error"]["param"] == param


def test_echo_puts_the_prompt_and_its_logprobs_first(server):
    client = server.client()
    plain = _completion(client, "t3 t4 t5", logprobs=2).choices[0]
    echoed = _completion(client, "t3 t4 t5", logprobs=2, echo=True).choices[0]
    assert echoed.text == "t3 t4 t5" + plain.text
    logprobs = echoed.logprobs
    assert len(logprobs.tokens) == 3 + 8 and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None and None not in logprobs.token_logprobs[1:]
    assert logprobs.token_logprobs[3:] == plain.logprobs.token_logprobs
    offsets = logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)
    streamed = _completion(client, [3, 4, 5], echo=True, stream=True)
    text = "".join(chunk.choices[0].text for chunk in streamed)
    ids_echoed = _completion(client, [3, 4, 5], echo=True).choices[0].text
    assert text == ids_echoed and ids_echoed.endswith(
        _completion(client, [3, 4, 5]).choices[0].text
    )
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "t3"}], extra_body={"echo": True}
        )


def test_prompt_logprobs_are_the_engines_own(server, checkpoint):
    from offload import LLM, SamplingParams

    client = server.client()
    choice = _completion(client, "t3 t4 t5", extra_body={"prompt_logprobs": 1}).choices[0]
    served = choice.model_extra["prompt_logprobs"]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    with LLM(checkpoint, device="cpu") as llm:
        [output] = llm.generate("t3 t4 t5", params, use_tqdm=False)
    expected = [
        None if e is None else {str(t): lp.logprob for t, lp in e.items()}
        for e in output.prompt_logprobs
    ]
    got = [None if e is None else {t: v["logprob"] for t, v in e.items()} for e in served]
    assert got == expected and got[0] is None and len(got) == 3
