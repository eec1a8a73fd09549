"""Fuzz `offload serve` with malformed requests (issue 48): 1,000 mutated bodies and headers
of /v1/completions and /v1/chat/completions (wrong types, missing fields, huge numbers, bad
Unicode, huge strings, broken JSON and HTTP), a correct request after a share of them, and
/health timed from another thread throughout. Records each answer's status, every 500 and
connection error, the server's RSS (the bar: within 1.5 GiB) and /health's latency (the
bar: within 1 s), into results/serve-fuzz-cpu-<date>.json. Not part of the test suite.

    nice -n 19 python benchmarks/serve_fuzz.py [--requests 1000] [--seed 0]
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import common
import torch

from offload.model.default import default_model_path

# A KV cache of 4 x 2048 positions (0.35 GiB in float32): the default 16 x 8192 alone is
# 5.6 GiB, beyond the RSS bar before any request.
SERVER_FLAGS = [
    "--no-progress",
    "--enforce-eager",
    "--max-num-seqs",
    "4",
    "--max-model-len",
    "2048",
]
RSS_LIMIT_BYTES = int(1.5 * 2**30)
HEALTH_LIMIT_S = 1.0
MAX_TOKENS = 4
# Values a field is set to: each wrong for some field, a few right for others.
ODD_VALUES = [
    None, True, False, 0, -1, 1, 2**31, 2**64, 10**400, 1e308, -1e308, 0.5, "", "x", "1",
    "true", "no", "inf", "NaN", [], [1, "a"], [[1]], {}, {"a": 1}, "\ud800", "t3 " * 200_000,
    [5] * 100_000, {"5": "inf"}, {"5": 1e308}, {"x": 1}, float("nan"), float("inf"),
]  # fmt: skip
FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "min_p", "n", "stop", "seed", "logprobs", "top_logprobs", "logit_bias",
    "stream", "stream_options", "ignore_eos", "echo", "best_of", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "stop_token_ids", "allowed_token_ids",
    "bad_words", "truncate_prompt_tokens", "chat_template", "chat_template_kwargs",
    "add_generation_prompt", "continue_final_message", "tools", "min_tokens",
    "skip_special_tokens", "include_stop_str_in_output", "prompt_logprobs", "suffix", "user",
]  # fmt: skip
PARTS = [5, ["a"], None, {"type": "image_url"}, {"type": "text"}, {"type": "text", "text": 5},
         "plain", {"type": "text", "text": "\ud800"}]  # fmt: skip


def _base(chat: bool) -> dict:
    if chat:
        return {"messages": [{"role": "user", "content": "Name a color."}],
                "max_tokens": MAX_TOKENS, "temperature": 0}  # fmt: skip
    return {"prompt": "The capital of France is", "max_tokens": MAX_TOKENS, "temperature": 0}


def _mutated(rng: random.Random) -> tuple[str, str, bytes, dict[str, str]]:
    """(kind, path, body, headers) of one malformed request."""
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = _base(chat)
    headers = {"Content-Type": "application/json"}
    kind = rng.choice(["field", "field", "field", "fields", "drop", "message", "raw", "header"])
    if kind in ("field", "fields"):
        for _ in range(1 if kind == "field" else rng.randint(2, 6)):
            body[rng.choice(FIELDS)] = rng.choice(ODD_VALUES)
    elif kind == "drop":
        body.pop(rng.choice(list(body)))
        body[rng.choice(FIELDS)] = rng.choice(ODD_VALUES)
    elif kind == "message":
        message = {"role": rng.choice(["user", 5, None, "", "tool"]),
                   "content": rng.choice([rng.sample(PARTS, 2), 5, None, "x", [], {}])}  # fmt: skip
        body["messages"] = rng.choice([[message], message, [], "x", [message] * 3])
        path = "/v1/chat/completions"
    raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    if kind == "raw":
        raw = rng.choice([
            raw[: rng.randint(0, len(raw))], b"\xff\xfe" + raw, b"[1, 2]", b"null", b"",
            b"[" * 50_000 + b"]" * 50_000, raw.replace(b"}", b"", 1), bytes(rng.randbytes(64)),
            b'{"prompt": "' + b"x" * (9 * 2**20) + b'"}',  # (beyond 8 MiB)
        ])  # fmt: skip
    elif kind == "header":
        headers = rng.choice([
            {"Content-Type": "text/plain"}, {},
            {"Content-Type": "application/json; charset=latin-1"},
            {"Content-Type": "application/json", "Authorization": "Bearer \xe9\xff"},
            {"Content-Type": "application/json", "X-Junk": "y" * 8000},
            {"Content-Type": "application/json", "Content-Encoding": "gzip"},
        ])  # fmt: skip
    return kind, path, raw, headers


class Fuzz:
    def __init__(self, port: int, pid: int):
        self.port, self.pid = port, pid
        self.statuses: collections.Counter = collections.Counter()
        self.by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.errors: list[dict] = []  # 500s and connection errors, with what was sent
        self.correct_failures: list[dict] = []
        self.health_s: list[float] = []
        self.rss_bytes: list[int] = []
        self._stop = threading.Event()

    def send(self, path: str, raw: bytes, headers: dict[str, str], timeout_s: float = 60):
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)
        try:
            connection.request("POST", path, raw, headers)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def correct(self, rng: random.Random) -> None:
        chat = rng.random() < 0.5
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = json.dumps(_base(chat)).encode()
        try:
            status, text = self.send(path, body, {"Content-Type": "application/json"})
            if status != 200 or not json.loads(text)["choices"]:
                self.correct_failures.append({"status": status, "body": text[:300].decode()})
        except OSError as error:
            self.correct_failures.append({"error": repr(error)})

    def watch_health(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                connection.request("GET", "/health")
                connection.getresponse().read()
                connection.close()
                self.health_s.append(time.monotonic() - started)
            except OSError:
                self.health_s.append(float("inf"))
            self.rss_bytes.append(_rss_bytes(self.pid))
            self._stop.wait(0.2)

    def run(self, count: int, seed: int, correct_share: float) -> None:
        rng = random.Random(seed)
        watcher = threading.Thread(target=self.watch_health, daemon=True)
        watcher.start()
        for number in range(count):
            kind, path, raw, headers = _mutated(rng)
            try:
                status, text = self.send(path, raw, headers)
            except (OSError, http.client.HTTPException) as error:
                status, text = "connection error", repr(error).encode()
            self.statuses[status] += 1
            self.by_kind[kind][status] += 1
            if status == "connection error" or (isinstance(status, int) and status >= 500):
                sent = raw[:300].decode("utf-8", "replace")
                self.errors.append({"number": number, "kind": kind, "path": path, "status": status,
                                    "headers": headers, "sent": sent,
                                    "answer": text[:500].decode("utf-8", "replace")})  # fmt: skip
            if rng.random() < correct_share:
                self.correct(rng)
            if number % 100 == 99:
                print(f"{number + 1}: {dict(self.statuses)}", file=sys.stderr, flush=True)
        self._stop.set()
        watcher.join()


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start(port: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "offload.cli", "serve", "--port", str(port),
               *SERVER_FLAGS]  # fmt: skip
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited: {log.read_text()[-2000:]}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return process
        except OSError:
            time.sleep(0.5)
    raise SystemExit("the server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--correct-share", type=float, default=0.2)
    args = parser.parse_args()
    default_model_path()  # (converted once, before the server's clock starts)
    port, log = _free_port(), Path("/tmp") / f"serve-fuzz-{time.time_ns()}.log"
    server = _start(port, log)
    fuzz = Fuzz(port, server.pid)
    started = time.monotonic()
    try:
        start_rss = _rss_bytes(server.pid)
        fuzz.run(args.requests, args.seed, args.correct_share)
        end_rss = _rss_bytes(server.pid)
    finally:
        server.terminate()
        exit_status = server.wait(timeout=60)
    tracebacks = log.read_text().count("Traceback")
    health = sorted(fuzz.health_s)
    payload = {
        "what": "offload serve fuzzed with malformed requests (benchmarks/serve_fuzz.py)",
        "model": "SmolLM2-135M-Instruct (the default)",
        "server_flags": SERVER_FLAGS,
        "requests": args.requests,
        "seed": args.seed,
        "seconds": round(time.monotonic() - started, 1),
        "statuses": {str(k): v for k, v in sorted(fuzz.statuses.items(), key=str)},
        "statuses_by_kind": {k: {str(s): n for s, n in c.items()} for k, c in fuzz.by_kind.items()},
        "num_500_or_connection_errors": len(fuzz.errors),
        "errors": fuzz.errors[:50],
        "correct_requests_failed": len(fuzz.correct_failures),
        "correct_failures": fuzz.correct_failures[:20],
        "rss_bytes": {"start": start_rss, "end": end_rss, "max": max(fuzz.rss_bytes)},
        # (sampled with /health every 0.2 s; every 25th sample: about one each 5 s)
        "rss_mib_trace": [round(b / 2**20) for b in fuzz.rss_bytes[::25]],
        "rss_within_1_5_gib": max(fuzz.rss_bytes) <= RSS_LIMIT_BYTES,
        "health_s": {"count": len(health), "median": health[len(health) // 2], "max": health[-1]},
        "health_within_1_s": health[-1] <= HEALTH_LIMIT_S,
        "server_tracebacks_logged": tracebacks,
        "server_exit_status": exit_status,
    }
    path = common.save("serve-fuzz", torch.device("cpu"), payload)
    print(json.dumps({k: v for k, v in payload.items() if k not in ("errors",)}, indent=1))
    print(path)


if __name__ == "__main__":
    main()
