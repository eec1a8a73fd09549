"""Serving throughput of `offload serve` (continuous batching) under N concurrent streaming
clients, for each way of holding the weights, with the per-token bound beside each figure.

    python benchmarks/serve.py [--settings resident uva prefetch disk] [--concurrency 1 4 16 32]
                               [--requests-per-client 2] [--max-tokens 32] [--model PATH]
                               [--peers transformers] [--quick] [--dtype float32]
                               [--compare-eager]

Each setting starts its own server (`python -m offload.cli serve MODEL --max-num-seqs 32
<flags>`, its stderr in a log file) and waits for GET /health:
  resident   --no-offload
  uva        --cpu-offload-gb G, G just above the bytes of every decoder layer
  prefetch   --offload-group-size 1 --offload-prefetch-step 2
  disk       --cpu-memory-gb 0 --disk-io direct (every decoder layer read with O_DIRECT)
After 2 warm-up requests, for each N: N client threads, each with its own `openai.OpenAI`
client, each sending `--requests-per-client` streamed chat completions (at N=1 at least 4),
greedy, `ignore_eos` so each makes exactly `--max-tokens` tokens. Client-side, per request:
TTFT (first token chunk - send) and inter-token latency (gaps between token chunks: ours
sends one per decode step per request, its text empty where the tokens decode to nothing);
tokens/s = completion tokens (from the usage chunks) / wall time of the whole N-client run.
GET /metrics before and after each run gives the bytes streamed (weights copied + read from
disk) and the forwards per output token.

The bound: one forward serves up to N tokens at concurrency N, so while a batch-N step costs
no more than a batch-1 step (true where moving the weights dominates, not on a CPU where
the compute grows with the batch), tokens/s <= N / t_step, t_step = the median inter-token
gap at N=1. The issue's target: 16 clients >= 6x one client's tokens/s.

`--peers transformers` runs the same workload on `transformers serve --continuous-batching`
over the same model folder; when it cannot run, the reason is printed and recorded.
`--quick`: resident only, N = 1 and 4, 1 request per client, 8 tokens (a smoke test).
`--dtype` is passed to each server (`float32`: the default model de-quantized, whose batches
run the compiled CPU step); `--compare-eager` runs each setting a second time with
`--enforce-eager` (eager batches), as "<setting> eager". A server compiles its step (or
loads it from disk) before it answers /health, so the runs time the step as it serves.

The clients run on the server's machine and take CPU from it; the CPU seconds of the server
and of the clients over each run are recorded beside the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import openai
import torch

sys.path.insert(0, str(Path(__file__).parent))
import common

from offload.model.default import default_model_path

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "What is the boiling point of water in Celsius?",
    "Who wrote Romeo and Juliet?",
    "What is the largest planet in our solar system?",
    "Give me a synonym for happy.",
    "What gas do plants absorb from the air?",
    "How many days are in a leap year?",
    "What is the square root of 81?",
    "Which ocean is the largest?",
    "What language is spoken in Brazil?",
    "Name a mammal that can fly.",
    "What is the chemical symbol for gold?",
    "How many continents are there?",
    "What is the freezing point of water in Fahrenheit?",
]
SERVED_NAME = "bench"
SETTINGS = ("resident", "uva", "prefetch", "disk")
FIXED_FLAGS = {
    "resident": ["--no-offload"],
    "prefetch": ["--offload-group-size", "1", "--offload-prefetch-step", "2"],
    "disk": ["--cpu-memory-gb", "0", "--disk-io", "direct"],
}
MAX_NUM_SEQS = 32
WARMUP_REQUESTS = 2
MIN_SINGLE_CLIENT_REQUESTS = 4  # N=1 has one request in flight: more of them for its medians
HEALTH_TIMEOUT_S = 300
STOP_TIMEOUT_S = 15
REQUEST_TIMEOUT_S = 600
TARGET_N, TARGET_RATIO = 16, 6.0
# /metrics names whose deltas around a run are recorded (vLLM's counter gets `_total`).
COUNTERS = {
    "copied": "offload:weight_bytes_copied_total",
    "disk": "offload:disk_bytes_read_total",
    "forwards": "offload:forwards_total",
    "generated": "vllm:generation_tokens_total",
}
_SAMPLE = re.compile(r"^(?P<name>[^\s{#]+)(?:\{[^}]*\})?\s+(?P<value>\S+)$")
_ROWS = re.compile(r"(\d+) sequences at once")  # from `offload serve`'s start line
_GIB = 2**30


# ---- the servers ----------------------------------------------------------------------


def decoder_layer_gib(model: Path) -> float:
    """GiB of every decoder layer's parameters, rounded up to 1/1000 GiB so that a UVA
    budget of this size takes them all (built on the meta device: nothing loaded)."""
    from offload.model.build import build_empty
    from offload.offloader.layers import find_layer_stacks
    from offload.sizes import parameter_bytes

    empty = build_empty(model, "auto", False)
    total = sum(parameter_bytes(b) for _, blocks in find_layer_stacks(empty) for b in blocks)
    return math.ceil(total / _GIB * 1000) / 1000


def setting_flags(setting: str, model: Path) -> list[str]:
    if setting == "uva":
        return ["--cpu-offload-gb", f"{decoder_layer_gib(model):.3f}"]
    return FIXED_FLAGS[setting]


def offload_command(model: Path, port: int, flags: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "offload.cli", "serve", str(model), "--port", str(port),
        "--served-model-name", SERVED_NAME, "--max-num-seqs", str(MAX_NUM_SEQS),
        "--no-progress", *flags,
    ]  # fmt: skip


def default_server(model: str | None, flags: list[str], name: str) -> Server:
    """`offload serve` of `model` (None: the default model) on its defaults plus `flags`,
    served as SERVED_NAME on a free port, its log in a folder named after `name`."""
    port = free_port()
    command = [sys.executable, "-m", "offload.cli", "serve", *([model] if model else [])]
    command += ["--port", str(port), "--served-model-name", SERVED_NAME, "--no-progress"]
    logs = Path(tempfile.mkdtemp(prefix=f"offload-{name}-"))
    return Server([*command, *flags], port, logs / "server.log")


def transformers_command(model: Path, port: int) -> list[str]:
    # Through Python rather than the `transformers` script, so that it is the same
    # interpreter (and packages) as ours wherever the script lives.
    launcher = "import sys; from transformers.cli.transformers import main; sys.exit(main())"
    return [
        sys.executable, "-c", launcher, "serve", str(model), "--continuous-batching",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Server:
    command: list[str]
    port: int
    log_path: Path
    # Ours promises exit code 0 on SIGTERM; a peer may die of the signal (-15) instead.
    clean_codes: tuple[int, ...] = (0,)
    process: subprocess.Popen | None = None
    startup_s: float | None = None
    exit: dict[str, object] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        started = time.perf_counter()
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        while time.perf_counter() - started < HEALTH_TIMEOUT_S:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"exited with code {self.process.returncode} before /health answered: "
                    f"{self.log_tail()}"
                )
            if http_status(f"{self.url}/health") == 200:
                self.startup_s = time.perf_counter() - started
                return
            time.sleep(0.5)
        raise RuntimeError(f"/health not 200 within {HEALTH_TIMEOUT_S} s: {self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM, as a user would; a server still up after STOP_TIMEOUT_S is killed (and
        that is recorded, as is an exit code other than `clean_codes`)."""
        if self.process is None or self.process.poll() is not None:
            self.exit = {"returncode": None if self.process is None else self.process.returncode}
            return
        asked = time.perf_counter()
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(STOP_TIMEOUT_S)
            self.exit = {"returncode": code, "seconds": time.perf_counter() - asked}
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            self.exit = {"returncode": None, "killed_after_s": STOP_TIMEOUT_S}
        if self.exit.get("returncode") not in self.clean_codes:
            print(f"  server did not exit cleanly on SIGTERM: {self.exit}; log {self.log_path}")

    @property
    def max_rows(self) -> int | None:
        """Sequences run at once, as ours says at start (fewer than --max-num-seqs where
        their KV cache does not fit in memory); None for a peer."""
        match = _ROWS.search(self.log_path.read_text(errors="replace"))
        return int(match[1]) if match else None

    def log_tail(self, lines: int = 8) -> str:
        text = self.log_path.read_text(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:]) or "(log empty)"


@contextlib.contextmanager
def running(server: Server) -> Iterator[Server]:
    try:
        server.start()
        yield server
    finally:
        server.stop()


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:  # not listening yet
        return None


def steps_settled(url: str, limit_s: float = 900.0) -> None:
    """Wait until no compiled step of the server loads or compiles in the background
    (`offload:step_jobs_pending` 0; a peer has none): until then steps run eagerly, which is
    not the steady state a benchmark measures."""
    deadline = time.monotonic() + limit_s
    while (scrape(url) or {}).get("offload:step_jobs_pending", 0.0) and time.monotonic() < deadline:
        time.sleep(1.0)


def scrape(url: str) -> dict[str, float] | None:
    """The samples of GET /metrics, each name's values summed over its labels; None where
    the server has no /metrics (a peer)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
            text = response.read().decode()
    except OSError:
        return None
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            name = match["name"]
            values[name] = values.get(name, 0.0) + float(match["value"])
    return values


# ---- the clients ----------------------------------------------------------------------


@dataclass
class Workload:
    model: str  # the name the server expects
    max_tokens: int
    extra_body: dict[str, object]


@dataclass
class Record:
    sent_s: float
    chunk_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    error: str | None = None


def one_request(client: openai.OpenAI, work: Workload, prompt: str) -> Record:
    record = Record(time.perf_counter())
    try:
        stream = client.chat.completions.create(
            model=work.model,
            messages=[{"role": "user", "content": prompt}],
            stream=True,
            stream_options={"include_usage": True},
            temperature=0,
            max_tokens=work.max_tokens,
            extra_body=work.extra_body,
        )
        for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                record.completion_tokens = chunk.usage.completion_tokens
            if chunk.choices and is_token_chunk(chunk.choices[0].delta):
                record.chunk_s.append(now)
    except Exception as error:  # a failed request is a figure too, not the end of the run
        record.error = f"{type(error).__name__}: {error}"
    return record


def is_token_chunk(delta) -> bool:
    """A chunk that carries tokens: one with a content field, less the role chunk a chat
    stream opens with before any token. Its text may be empty (tokens that decode to
    nothing: the special tokens that `ignore_eos` lets through, part of a character);
    counting only chunks with text showed those steps as one gap of several steps."""
    return delta.content is not None and not (delta.role and delta.content == "")


def new_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=REQUEST_TIMEOUT_S
    )


def run_clients(url: str, work: Workload, n: int, per_client: int) -> tuple[list[Record], float]:
    """N threads, each with its own client (own connection pool, as separate users would
    have), each sending `per_client` requests one after the other; the records and the wall
    time from the first send to the last token."""
    clients = [new_client(url) for _ in range(n)]
    records: list[list[Record]] = [[] for _ in range(n)]

    def client_loop(i: int) -> None:
        for j in range(per_client):
            # Concurrent requests get different prompts, so their lengths differ.
            prompt = PROMPTS[(i + j * n) % len(PROMPTS)]
            records[i].append(one_request(clients[i], work, prompt))

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(n)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    for client in clients:
        client.close()
    return [record for mine in records for record in mine], wall


# ---- the figures ----------------------------------------------------------------------


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}


def streamed(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """Deltas of the server's counters over a run, per output token."""
    if before is None or after is None:
        return {"counters": None, "mib_streamed_per_token": None, "forwards_per_token": None}
    delta = {key: after.get(name, 0.0) - before.get(name, 0.0) for key, name in COUNTERS.items()}
    tokens = delta["generated"]
    if tokens <= 0:
        return {"counters": delta, "mib_streamed_per_token": None, "forwards_per_token": None}
    return {
        "counters": delta,
        "mib_streamed_per_token": (delta["copied"] + delta["disk"]) / tokens / 2**20,
        "forwards_per_token": delta["forwards"] / tokens,
    }


def summarize(n: int, records: list[Record], wall: float, before, after) -> dict:
    ok = [r for r in records if r.error is None]
    tokens = sum(r.completion_tokens for r in ok)
    row = {
        "concurrency": n,
        "requests": len(records),
        "errors": len(records) - len(ok),
        "error_examples": sorted({r.error for r in records if r.error})[:3],
        "completion_tokens": tokens,
        "content_chunks": sum(len(r.chunk_s) for r in ok),
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_ms": percentiles([(r.chunk_s[0] - r.sent_s) * 1e3 for r in ok if r.chunk_s]),
        "itl_ms": percentiles(
            [(b - a) * 1e3 for r in ok for a, b in zip(r.chunk_s, r.chunk_s[1:], strict=False)]
        ),
        **streamed(before, after),
    }
    counted = (row["counters"] or {}).get("generated")
    if counted is not None and counted != tokens:  # the server's count and the usage chunks'
        print(f"  N={n}: /metrics counted {counted:.0f} tokens, the usage chunks {tokens}")
    return row


def add_bounds(rows: list[dict], max_rows: int | None) -> float | None:
    """Beside each row: its ratio to N=1; the bound N / t_step, t_step the median gap
    between tokens of the one request in flight at N=1 (returned; None without N=1); and
    the bound at this N's own step, rows / (median gap at N), which a step that grows with
    the batch (compute, on a CPU) lowers: below it, the time went to prefills, waiting and
    the tail of the run rather than to decode steps."""
    single = next((r for r in rows if r["concurrency"] == 1 and r["tokens_per_s"] > 0), None)
    step_ms = single["itl_ms"]["p50"] if single else None
    for row in rows:
        n = row["concurrency"]
        row["ratio_to_n1"] = row["tokens_per_s"] / single["tokens_per_s"] if single else None
        bound = n / (step_ms / 1e3) if step_ms else None
        row["bound_tokens_per_s"] = bound
        row["share_of_bound"] = row["tokens_per_s"] / bound if bound else None
        gap_ms = row["itl_ms"]["p50"]
        rows_run = min(n, max_rows) if max_rows else n  # more clients than rows: some wait
        row["step_bound_tokens_per_s"] = rows_run / (gap_ms / 1e3) if gap_ms else None
    return step_ms / 1e3 if step_ms else None


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(title: str, rows: list[dict], step_s: float | None) -> None:
    print(f"\n{title}")
    print(
        f"{'N':>4}{'tok/s':>9}{'x N=1':>7}{'bound':>9}{'of bound':>10}{'at N step':>11}{'TTFT p50':>10}"
        f"{'p99':>8}{'ITL p50':>9}{'p99':>8}{'MiB/tok':>9}{'fwd/tok':>9}{'errors':>8}"
    )
    for row in rows:
        print(
            f"{row['concurrency']:>4}{row['tokens_per_s']:>9.1f}{fmt(row['ratio_to_n1'], '.2f'):>7}"
            f"{fmt(row['bound_tokens_per_s'], '.0f'):>9}{fmt(row['share_of_bound'], '.0%'):>10}"
            f"{fmt(row['step_bound_tokens_per_s'], '.0f'):>11}"
            f"{fmt(row['ttft_ms']['p50'], '.0f'):>10}{fmt(row['ttft_ms']['p99'], '.0f'):>8}"
            f"{fmt(row['itl_ms']['p50'], '.1f'):>9}{fmt(row['itl_ms']['p99'], '.1f'):>8}"
            f"{fmt(row['mib_streamed_per_token'], '.1f'):>9}"
            f"{fmt(row['forwards_per_token'], '.3f'):>9}{row['errors']:>8}"
        )
        for example in row["error_examples"]:
            print(f"      error: {example}")
    if step_s is not None:
        print(
            f"  bound: tok/s <= N / t_step, t_step = {step_s * 1e3:.1f} ms (median gap between "
            f"tokens at N=1: one batch-1 decode step), i.e. at most N x N=1's step rate; "
            f"'at N step': rows / median gap at N (the bound with N's own step time)"
        )
    target = next((r for r in rows if r["concurrency"] == TARGET_N), None)
    if target and target["ratio_to_n1"] is not None:
        verdict = "met" if target["ratio_to_n1"] >= TARGET_RATIO else "NOT met"
        print(
            f"  target: {TARGET_N} clients >= {TARGET_RATIO:.0f}x one client's tok/s: "
            f"{target['ratio_to_n1']:.2f}x ({verdict})"
        )


# ---- one server, every N ----------------------------------------------------------------


@dataclass
class Plan:
    concurrency: list[int]
    per_client: int
    min_single: int  # requests per client at N=1


def bench(title: str, server: Server, work: Workload, plan: Plan) -> dict:
    """Start the server, run every N, stop it; a server that fails is recorded, not raised."""
    result: dict[str, object] = {"command": server.command, "log": str(server.log_path)}
    try:
        with running(server):
            print(f"\n{title}: up in {server.startup_s:.1f} s (log {server.log_path})")
            warm, _ = run_clients(server.url, work, 1, WARMUP_REQUESTS)
            failed = [r.error for r in warm if r.error]
            if failed:
                raise RuntimeError(f"warm-up request failed: {failed[0]}")
            rows = [run_one(server, work, plan, n) for n in plan.concurrency]
    except Exception as error:  # this setting's failure must not lose the others' figures
        result["error"] = f"{type(error).__name__}: {error}"
        print(f"\n{title}: FAILED: {result['error']}")
        return {**result, "startup_s": server.startup_s, "exit": server.exit}
    step_s = add_bounds(rows, server.max_rows)
    print_table(title, rows, step_s)
    return {**result, "startup_s": server.startup_s, "exit": server.exit, "step_s": step_s,
            "max_rows": server.max_rows, "runs": rows}  # fmt: skip


def run_one(server: Server, work: Workload, plan: Plan, n: int) -> dict:
    per_client = max(plan.min_single, plan.per_client) if n == 1 else plan.per_client
    before, cpu_before = scrape(server.url), cpu_seconds(server.process.pid)
    records, wall = run_clients(server.url, work, n, per_client)
    row = summarize(n, records, wall, before, scrape(server.url))
    row["cpu_s"] = {
        key: cpu_seconds(server.process.pid)[key] - cpu_before[key] for key in cpu_before
    }
    print(
        f"  N={n}: {row['tokens_per_s']:.1f} tok/s over {wall:.1f} s; CPU s: server "
        f"{row['cpu_s']['server']:.1f}, clients {row['cpu_s']['clients']:.1f}",
        flush=True,
    )
    return row


def cpu_seconds(server_pid: int) -> dict[str, float]:
    """CPU time of the server process and of this one (the clients): the clients share the
    machine's cores with the server, so their cost is part of the figures (Linux /proc)."""
    fields = Path(f"/proc/{server_pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime + stime
    return {"server": ticks / os.sysconf("SC_CLK_TCK"), "clients": time.process_time()}


def bench_setting(
    setting: str, model: Path, work: Workload, plan: Plan, logs: Path, extra: list[str]
) -> dict:
    flags = setting_flags(setting.removesuffix(" eager"), model) + extra
    if setting.endswith(" eager"):
        flags.append("--enforce-eager")
    port = free_port()
    log = logs / f"{setting.replace(' ', '-')}.log"
    server = Server(offload_command(model, port, flags), port, log)
    return {"flags": flags, **bench(f"offload serve, {setting}", server, work, plan)}


def bench_transformers(model: Path, max_tokens: int, plan: Plan, logs: Path) -> dict:
    port = free_port()
    log = logs / "transformers.log"
    server = Server(transformers_command(model, port), port, log, (0, -signal.SIGTERM))
    # transformers' server rejects unknown fields (`ignore_eos`: 422); a generation config
    # of its own has no EOS token, so every request runs to max_tokens there too.
    extra = {"generation_config": json.dumps({"do_sample": False})}
    work = Workload(str(model), max_tokens, extra)
    result = bench("transformers serve --continuous-batching", server, work, plan)
    if "error" in result:
        result["skipped"] = result["error"]
    return result


# ---- results --------------------------------------------------------------------------


def plot(payload: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG")
        return
    figure, axes = plt.subplots(figsize=(7, 4.5))
    lines = {**payload["settings"], **payload["peers"]}
    for name, result in lines.items():
        rows = result.get("runs") or []
        if rows:
            xs = [r["concurrency"] for r in rows]
            axes.plot(xs, [r["tokens_per_s"] for r in rows], marker="o", label=name)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("concurrent clients")
    axes.set_ylabel("output tokens/s")
    axes.set_title(f"offload serve, {payload['max_tokens']} tokens per request")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path.with_suffix(".png"), dpi=120)
    print(f"saved {path.with_suffix('.png')}")


def settings_of(settings: list[str], compare_eager: bool) -> list[str]:
    """Each setting, and after it (`compare_eager`) the same with --enforce-eager."""
    return [v for s in settings for v in ([s, f"{s} eager"] if compare_eager else [s])]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model folder (default: the default model)")
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16, 32])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--peers", nargs="*", choices=["transformers"], default=[])
    parser.add_argument("--quick", action="store_true", help="resident, N=1 and 4, 8 tokens")
    parser.add_argument("--dtype", help="passed to each server (float32: de-quantized)")
    parser.add_argument(
        "--compare-eager", action="store_true", help="each setting again with --enforce-eager"
    )
    args = parser.parse_args()
    if args.quick:
        args.settings, args.concurrency = ["resident"], [1, 4]
        args.requests_per_client, args.max_tokens = 1, 8
    return args


def main() -> None:
    args = parse_args()
    model = args.model or default_model_path()
    min_single = args.requests_per_client if args.quick else MIN_SINGLE_CLIENT_REQUESTS
    plan = Plan(args.concurrency, args.requests_per_client, min_single)
    work = Workload(SERVED_NAME, args.max_tokens, {"ignore_eos": True})
    logs = Path(tempfile.mkdtemp(prefix="offload-serve-bench-"))
    extra = ["--dtype", args.dtype] if args.dtype else []
    payload: dict[str, object] = {
        "model": str(model),
        "max_tokens": args.max_tokens,
        "requests_per_client": args.requests_per_client,
        "requests_at_n1": max(min_single, args.requests_per_client),
        "max_num_seqs": MAX_NUM_SEQS,
        "concurrency": args.concurrency,
        "target": f"{TARGET_N} clients >= {TARGET_RATIO:.0f}x one client's tokens/s",
        "dtype": args.dtype,
        "settings": {
            s: bench_setting(s, model, work, plan, logs, extra)
            for s in settings_of(args.settings, args.compare_eager)
        },
        "peers": {p: bench_transformers(model, args.max_tokens, plan, logs) for p in args.peers},
    }
    path = common.save("serve", torch.device("cpu"), payload)
    print(f"\nsaved {path}")
    plot(payload, path)


if __name__ == "__main__":
    main()
