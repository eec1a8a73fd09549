"""`offload serve --data-parallel-size 2`: two engine processes behind one server, each
request sent to the one with fewer in flight: answers as one engine's, both replicas
used, /metrics per replica and summed; a replica killed, the server answers on the other;
SIGTERM ends the front and every replica."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
from http_server import Server, chat_checkpoint, http
from prometheus_client.parser import text_string_to_metric_families

from offload import LLM, SamplingParams
from offload.probes.host import child_pids
from offload.server.replicas import replica_argv

CHATS = [[{"role": "user", "content": f"a b {word}"}] for word in ("c", "d", "e", "f")]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return chat_checkpoint(tmp_path_factory.mktemp("dp") / "chat")


def test_replica_arguments_leave_the_front_its_own():
    argv = ["serve", "M", "--port", "9000", "-dp", "2", "--host=0.0.0.0", "--max-num-seqs", "4"]
    assert replica_argv(argv) == [
        "serve", "M", "--max-num-seqs", "4", "--host", "127.0.0.1", "--port", "0",
    ]  # fmt: skip


def test_two_replicas_answer_as_one_and_outlive_one_of_them(path):
    with LLM(str(path), device="cpu", enforce_eager=True) as llm:
        params = SamplingParams(temperature=0, max_tokens=8)
        expected = [out.outputs[0].text for out in llm.chat(CHATS, params, use_tqdm=False)]
    server = Server(path, "--data-parallel-size", "2", "--enforce-eager")
    try:
        client = server.client()
        answers: dict[int, str] = {}

        def ask(index: int) -> None:
            answer = client.chat.completions.create(
                model="tiny", messages=CHATS[index], temperature=0, max_tokens=8
            )
            answers[index] = answer.choices[0].message.content

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(CHATS))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert [answers[i] for i in range(len(CHATS))] == expected
        status, text = http(server.url + "/metrics")
        assert status == 200
        [family] = [
            f for f in text_string_to_metric_families(text) if f.name == "vllm:prompt_tokens"
        ]
        totals = [s for s in family.samples if s.name == "vllm:prompt_tokens_total"]
        per_replica = {s.labels.get("replica"): s.value for s in totals}
        assert per_replica["0"] > 0 and per_replica["1"] > 0  # (both were sent requests)
        assert per_replica[None] == per_replica["0"] + per_replica["1"]
        replicas = child_pids(server.process.pid)
        assert len(replicas) == 2
        os.kill(replicas[0], signal.SIGKILL)
        for index in range(2):  # (the other replica answers)
            ask(index)
            assert answers[index] == expected[index]
        assert http(server.url + "/health")[0] == 200
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=30) == 0
        assert not any(Path(f"/proc/{pid}").exists() for pid in replicas[1:])
    finally:
        server.stop()
