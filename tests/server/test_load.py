"""The server under load and faults: 300 requests from 32 clients on loopback, with
clients that leave mid-stream, malformed bodies, prompts longer than the context and
failing disk reads in the weight stream. At the end it still serves, every completed
greedy answer is right, its RSS is back near its level after warm-up and no thread is
left. The server runs in this process (so that the test can make the disk fail), the
clients in another (so that this process's memory is the server's)."""

from __future__ import annotations

import collections
import errno
import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
from http_server import InProcess, chat_checkpoint, http
from load_clients import MAX_TOKENS, PROMPTS

from offload import SamplingParams
from offload.llm.llm import LLM
from offload.memory import disk_reader
from offload.probes.host import process_memory_bytes

CLIENTS = Path(__file__).parents[1] / "load_clients.py"


def _clients(url, clients, requests, seed, expected) -> list:
    command = [sys.executable, str(CLIENTS), url, str(clients), str(requests), str(seed),
               json.dumps(expected)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(CLIENTS.parent)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def _rss() -> int:
    gc.collect()
    return process_memory_bytes()["rss_bytes"]


def _offload_threads() -> set[threading.Thread]:
    for thread in threading.enumerate():
        if thread.name.startswith("offload-"):
            thread.join(timeout=10)  # told to end: let them
    return {t for t in threading.enumerate() if t.name.startswith("offload-")}


def test_300_requests_with_leavers_bad_input_and_disk_faults(tmp_path, monkeypatch):
    path = chat_checkpoint(tmp_path)
    with LLM(path) as resident:
        greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        expected = [o.outputs[0].text for o in resident.generate(PROMPTS, greedy, use_tqdm=False)]
    before_threads = _offload_threads()
    llm = LLM(path, cpu_memory_gb=0, disk_io="direct", max_num_seqs=32)
    server = InProcess(llm, max_waiting=64)
    try:
        _clients(server.url, 8, 5, 1, expected)  # warm-up: 40 requests
        warm_rss = _rss()
        real_preadv = disk_reader.os.preadv

        def failing(*args):
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        def fault():  # the disk fails for a moment, twice, while clients are busy
            for _ in range(2):
                busy = llm._forwards + 30
                while llm._forwards < busy:
                    time.sleep(0.01)
                monkeypatch.setattr(disk_reader.os, "preadv", failing)
                time.sleep(0.2)
                monkeypatch.setattr(disk_reader.os, "preadv", real_preadv)

        faults = threading.Thread(target=fault)
        faults.start()
        outcomes = _clients(server.url, 32, 10, 2, expected)
        faults.join()
        kinds = collections.Counter(kind for kind, _ in outcomes)
        assert len(outcomes) == 320 and kinds["fault"] > 0, kinds
        assert {"answer", "stream", "leave", "malformed", "too-long"} <= set(kinds)
        wrong = [o for o in outcomes if not o[1]]
        assert not wrong, (wrong[:5], kinds)
        # Still serving, right, and healthy once the disk reads again.
        answer = openai.OpenAI(base_url=server.url + "/v1", api_key="x").completions.create(
            model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert answer.choices[0].text == expected[0]
        assert http(server.url + "/health")[0] == 200
        rss = _rss()
        assert rss <= 1.05 * warm_rss, (rss / 2**20, warm_rss / 2**20)
    finally:
        server.stop()
        llm.close()
    # (a thread of an earlier test's LLM may end meanwhile: only new ones count)
    left = _offload_threads() - before_threads
    assert not left, sorted(t.name for t in left)
