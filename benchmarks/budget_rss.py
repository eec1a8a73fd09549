"""Peak RSS against `--cpu-memory-gb` at a real size (issue 47 part 1): a random bf16 Llama
of ~2.6 GB, `offload generate` with the page cache warm and cold, and `offload serve` under
4 concurrent clients, each in a fresh process whose peak RSS (`ru_maxrss` of that child,
from `wait4`) is read when it ends. Greedy tokens are compared across runs.

    python benchmarks/budget_rss.py --model /tmp/budget-llama --src src [--build]

`--src` picks the package copy that runs (a checkout's `src`), so that two versions are
measured by one script; `--build` writes the model first (one shard per ~layer, bounded
memory). The budget rule says peak RSS <= budget + the fixed overhead, which the figures
line of `offload generate` states.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import common
import torch

GIB = 2**30
PROMPT = "The history of the city of Lyon begins"
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "dtype": "bfloat16",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build(folder: Path) -> None:
    """The random model (weights N(0, 0.02), norms 1) with the default model's tokenizer."""
    from offload.bench.checkpoint import write_random_checkpoint
    from offload.model.default import default_model_path

    if not (folder / "model.safetensors.index.json").is_file():
        write_random_checkpoint(folder, CONFIG, max_shard_bytes=120 * 2**20, seed=0)
    tokenizer = default_model_path()
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, folder / name)


def set_cache(folder: Path, warm: bool) -> None:
    from offload.memory.page_cache import drop_cached, read_cached

    files = sorted(folder.glob("*.safetensors"))
    if warm:
        read_cached(files)
    else:
        drop_cached(files)


def run_child(argv: list[str], src: Path, timeout_s: float) -> tuple[int, str, float]:
    """(exit status, stdout + stderr, peak RSS in GiB) of one process run to its end."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    child = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    timer = threading.Timer(timeout_s, child.kill)
    timer.start()
    out = child.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(child.pid, 0)
    timer.cancel()
    child.returncode = os.waitstatus_to_exitcode(status)
    return child.returncode, out, usage.ru_maxrss * 1024 / GIB


def generate(model: Path, src: Path, budget_gb: float | None, extra: list[str]) -> dict:
    """One `offload generate` (no budget: `budget_gb` None, every weight resident)."""
    argv = [sys.executable, "-m", "offload.cli", "generate", "--model", str(model)]
    argv += ["--prompt", PROMPT, "--max-tokens", "8", "--temperature", "0", "--no-progress"]
    budget = ["--cpu-memory-gb", str(budget_gb)] if budget_gb is not None else ["--no-offload"]
    argv += [*budget, *extra]
    started = time.perf_counter()
    status, out, peak_gib = run_child(argv, src, timeout_s=1800)
    lines = [line for line in out.splitlines() if line.strip()]
    figures = next((line for line in lines if line.startswith("[")), "")
    answer = lines[lines.index(figures) - 1] if figures in lines and lines.index(figures) else ""
    return {
        "status": status,
        "peak_rss_gib": round(peak_gib, 3),
        "wall_s": round(time.perf_counter() - started, 1),
        "answer": answer,
        "figures": figures,
        "tail": out[-600:] if status else "",
    }


def serve(model: Path, src: Path, budget_gb: float, num_clients: int, extra: list[str]) -> dict:
    """`offload serve` on a free loopback port; `num_clients` greedy requests at once."""
    port = _free_port()
    argv = [sys.executable, "-m", "offload.cli", "serve", "--model", str(model)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--no-progress"]
    argv += ["--cpu-memory-gb", str(budget_gb), *extra]
    env = {**os.environ, "PYTHONPATH": str(src)}
    log = open(f"/tmp/budget-serve-{port}.log", "w+b")  # noqa: SIM115 (read after the end)
    child = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    answers: list[str] = []
    try:
        _wait_ready(port, child, timeout_s=1800)
        threads = [
            threading.Thread(target=lambda: answers.append(_answer(port)))
            for _ in range(num_clients)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=1800)
    except OSError as error:  # (TimeoutError and HTTPError are OSErrors)
        answers.append(f"error: {error}")
    finally:
        child.send_signal(signal.SIGINT)
        timer = threading.Timer(120, child.kill)
        timer.start()
        _, status, usage = os.wait4(child.pid, 0)
        timer.cancel()
    log.seek(0)
    text = log.read().decode(errors="replace")
    return {
        "status": os.waitstatus_to_exitcode(status),
        "peak_rss_gib": round(usage.ru_maxrss * 1024 / GIB, 3),
        "answers": answers,
        "log": [line for line in text.splitlines() if "KV cache" in line or "serve" in line],
    }


def _answer(port: int) -> str:
    try:
        return _complete(port)
    except OSError as error:
        return f"error: {error}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_ready(port: int, child: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise OSError(f"the server ended with status {child.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError("the server did not answer in time")


def _complete(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=60) as models:
        name = json.loads(models.read())["data"][0]["id"]
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "model": name}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=1800) as response:
        return json.loads(response.read())["choices"][0]["text"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("/tmp/budget-llama"))
    parser.add_argument("--src", type=Path, default=Path(__file__).parents[1] / "src")
    parser.add_argument("--build", action="store_true")
    parser.add_argument(
        "--runs",
        nargs="+",
        default=["warm", "cold", "serve"],
        help="of: warm, cold (generate with the budget), direct (warm, --disk-io direct), "
        "resident (warm, no budget, no offloading), serve (warm, 4 clients)",
    )
    parser.add_argument("--budget-gb", type=float, default=1.0)
    parser.add_argument("--serve-budget-gb", type=float, default=0.5)
    parser.add_argument("--extra", nargs="*", default=[], help="more flags for every run")
    parser.add_argument("--out", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.build:
        build(args.model)
    results: dict[str, dict] = {"src": str(args.src.resolve()), "load": os.getloadavg()}
    for run in args.runs:
        set_cache(args.model, warm=run != "cold")
        if run == "serve":
            results[run] = serve(args.model, args.src, args.serve_budget_gb, 4, args.extra)
        elif run == "resident":
            results[run] = generate(args.model, args.src, None, args.extra)
        else:
            extra = [*args.extra, *(["--disk-io", "direct"] if run == "direct" else [])]
            results[run] = generate(args.model, args.src, args.budget_gb, extra)
        print(run, json.dumps(results[run], indent=1), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    payload = {"model": CONFIG, "runs": results}
    print("saved", common.save("budget-rss", torch.device("cpu"), payload))


if __name__ == "__main__":
    main()
