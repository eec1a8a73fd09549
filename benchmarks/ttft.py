"""Time to first token of `offload generate` on a machine that has compiled nothing yet
(issue 47: with the step compiled in the background it is the eager time + at most 2 s),
and on the next run, which loads the kept step.

    python benchmarks/ttft.py [--model PATH] [--repeats 3] [--max-tokens 32] [--cpu-memory-gb B]

Each run is a fresh `offload generate` process (the console script beside this Python)
with its default question, streamed; the time to first token is from the process's start to the
first byte of the answer on its stdout, the whole run's time beside it. Conditions:
  eager       OFFLOAD_CPU_COMPILE=0: no compiled step (the reference)
  first       the default, on a fresh compiled-step cache and a fresh inductor cache: the
              step compiles on a thread while the first tokens decode eagerly
  kept        the default, with the step the "first" run kept: loaded, not compiled
  wait        OFFLOAD_CPU_COMPILE=wait, fresh caches: the first token waits for the compile
The model's conversion (the default model's GGUF as stored) is made once before, in a
cache every run copies, so each run's cache holds the converted model and no step.
Results: benchmarks/results/ttft-cpu-<date>.json (machine, date, every run, medians).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common
import torch

BOUND_S = 2.0  # the allowance over the eager time


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--cpu-memory-gb", type=float, default=None)
    return parser.parse_args()


def offload_command() -> list[str]:
    script = Path(sys.executable).with_name("offload")
    return [str(script)] if script.exists() else [sys.executable, "-m", "offload.cli"]


def run_once(args: argparse.Namespace, cache: Path, compile_mode: str | None) -> dict:
    """One `offload generate` in a fresh process: seconds to the answer's first byte and to
    its end, and the answer."""
    # (no --prompt: the default question, as a chat, as the README's first command runs it)
    command = [*offload_command(), "generate", "--max-tokens", str(args.max_tokens)]
    if args.model:
        command += ["--model", args.model]
    if args.cpu_memory_gb is not None:
        command += ["--cpu-memory-gb", str(args.cpu_memory_gb)]
    env = dict(os.environ, OFFLOAD_CACHE_DIR=str(cache / "offload"))
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
    env.pop("OFFLOAD_CPU_COMPILE", None)
    if compile_mode is not None:
        env["OFFLOAD_CPU_COMPILE"] = compile_mode
    started = time.perf_counter()
    # (unbuffered: read(1) takes one byte, and communicate() gets all the rest)
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0
    )
    first_byte = process.stdout.read(1)
    ttft_s = time.perf_counter() - started
    rest, stderr = process.communicate(timeout=900)
    total_s = time.perf_counter() - started
    if process.returncode != 0:
        raise SystemExit(f"offload generate failed ({process.returncode}): {stderr[-800:]!r}")
    answer = (first_byte + rest).decode().strip().splitlines()
    return {"ttft_s": ttft_s, "total_s": total_s, "answer": answer[0] if answer else ""}


def prepared_cache(args: argparse.Namespace, root: Path) -> Path:
    """A cache holding the converted model and no compiled step (one eager run makes it)."""
    template = root / "template"
    run_once(args, template, "0")
    shutil.rmtree(template / "inductor", ignore_errors=True)
    shutil.rmtree(template / "offload" / "compiled-steps", ignore_errors=True)
    return template


def fresh_copy(template: Path, into: Path) -> Path:
    shutil.rmtree(into, ignore_errors=True)
    shutil.copytree(template, into, symlinks=True)
    return into


def main() -> None:
    args = parse_args()
    runs: dict[str, list[dict]] = {"eager": [], "first": [], "kept": [], "wait": []}
    with tempfile.TemporaryDirectory(dir=Path.home()) as folder:  # (a folder we own)
        root = Path(folder)
        os.chmod(root, 0o700)
        template = prepared_cache(args, root)
        for repeat in range(args.repeats):
            cache = fresh_copy(template, root / "run")
            runs["eager"].append(run_once(args, cache, "0"))
            cache = fresh_copy(template, root / "run")
            runs["first"].append(run_once(args, cache, None))
            runs["kept"].append(run_once(args, cache, None))  # (the step "first" kept)
            cache = fresh_copy(template, root / "run")
            runs["wait"].append(run_once(args, cache, "wait"))
            print(f"round {repeat + 1}: " + ", ".join(
                f"{name} {rows[-1]['ttft_s']:.2f} s" for name, rows in runs.items()
            ), flush=True)  # fmt: skip
    medians = {name: statistics.median(r["ttft_s"] for r in rows) for name, rows in runs.items()}
    answers = {name: {r["answer"] for r in rows} for name, rows in runs.items()}
    over = medians["first"] - medians["eager"]
    print(f"\ntime to first token of `offload generate` ({args.repeats} runs each, medians):")
    for name, seconds in medians.items():
        total = statistics.median(r["total_s"] for r in runs[name])
        print(f"  {name:<6} {seconds:6.2f} s   (whole run {total:6.2f} s)")
    verdict = "within" if over <= BOUND_S else "OVER"
    print(f"first - eager = {over:+.2f} s ({verdict} the bound of +{BOUND_S:.0f} s)")
    print("answers: " + "; ".join(f"{k}: {sorted(v)}" for k, v in answers.items()))
    path = common.save(
        "ttft",
        torch.device("cpu"),
        {
            "model": args.model or "default",
            "max_tokens": args.max_tokens,
            "cpu_memory_gb": args.cpu_memory_gb,
            "loadavg_after": list(os.getloadavg()),
            "bound_over_eager_s": BOUND_S,
            "median_ttft_s": medians,
            "first_over_eager_s": over,
            "runs": runs,
        },
    )
    print(f"saved {path}")


if __name__ == "__main__":
    main()
