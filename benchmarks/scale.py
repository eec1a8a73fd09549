"""offload at real sizes (issue 47): random 1.4 GiB Q4_0 GGUF and 2.7 GiB bfloat16 Llamas,
each method in a fresh process, against the bound of the bytes it moves per token.

    python benchmarks/scale.py --build FOLDER [--large] [--only-build]
        [--models gguf bf16] [--methods resident uva disk-auto disk-direct serve accelerate]
        [--conditions first cold warm] [--rounds 3] [--max-tokens 16] [--clients 1 4]
        [--budget-gguf 0.5] [--budget-bf16 1.0] [--cap-gib 12] [--timeout-s 3600]

`--build FOLDER`: the models (`scale_models.py`) are written there once and reused; the
runs' caches go under FOLDER/runs. Methods, through the public API as a user writes them:
  resident     LLM(model)
  uva          LLM(model, cpu_offload_gb=<every weight>) (on a CPU: read in place)
  disk-auto    LLM(model, cpu_memory_gb=B, disk_io="auto"), B: --budget-gguf / --budget-bf16
  disk-direct  the same with disk_io="direct"
  disk-cache   the same with disk_io="page-cache"
  disk-mmap    the same with disk_io="mmap"
  serve        `offload serve MODEL --cpu-memory-gb B` (its defaults otherwise), one warm-up
               answer, then --rounds runs of N streamed chats for each N of --clients
  accelerate   (safetensors only) accelerate's device_map="auto", max_memory={"cpu": B}:
               offload bench's own method (`offload.bench.peers.AccelerateMap`)
Conditions, each its own process: "first" with a fresh OFFLOAD_CACHE_DIR and inductor
cache (a machine's first run: conversions and compiles; the cache's growth is recorded),
the model's files and that cache dropped from the page cache; "cold": the cache kept, its
files and the model's dropped again (`posix_fadvise(POSIX_FADV_DONTNEED)`, not the
machine-wide drop_caches: other programs share this machine); "warm": all of them read
into the page cache first. resident and uva read the files at load only: first and warm.

Figures per run (`scale_child.py`): peak RSS (VmHWM), load time, the first token's wait
(first prefill + the compile of the first answer), time to first token and decode tok/s
(medians over rounds), whether greedy tokens equal resident's. The bound: bytes a token
reads as stored (the decoder stack + the head) over the RAM read rate, or the bytes each
forward read from disk over the disk's O_DIRECT rate on the model's own files if slower
(both measured before and after each run, their mean: they drift with the machine's load);
served at N clients, N tokens a step (its decode rate: N over the median gap between a
stream's tokens). The memory allowance where a budget B is given: B + the fixed overhead
the run states (`LLM.fixed_overhead`: the process, the weights outside the decoder stack,
the tokenizer; the server states it on its start line; where none is stated: the RSS
after importing torch, transformers and offload, plus the weights outside the stack),
+25% (the issue's check). A process is killed above
--cap-gib (recorded). Results: benchmarks/results/scale-cpu-<date>.json, with the machine,
the models' manifests and every run; FOLDER/scale-partial.json grows run by run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common
import scale_models
import scale_runs

# What a user gets: the compiled CPU step made in the background while the first tokens
# decode eagerly (common.py asks the other scripts' steps to wait for their compile).
os.environ.pop("OFFLOAD_CPU_COMPILE", None)

from offload.config import OffloadConfig
from offload.memory.disk_reader import CHUNK_BYTES
from offload.probes.limits import Limits, measure_memory_read
from offload.probes.settings import MeasureSettings

METHODS = (
    "resident",
    "uva",
    "disk-auto",
    "disk-direct",
    "disk-cache",
    "disk-mmap",
    "serve",
    "accelerate",
)
CONDITIONS = ("first", "cold", "warm")
LOAD_ONLY = ("resident", "uva")  # read their files at load only: no cold runs
PROMPT = "The history of the old harbour town begins with a small fishing village that"
SLACK = 1.25
GIB = 2**30


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build", type=Path, default=Path("/tmp/offload-scale"))
    parser.add_argument("--large", action="store_true", help="also the 6.2 GB bf16 model")
    parser.add_argument("--only-build", action="store_true")
    parser.add_argument("--models", nargs="+", default=None, choices=tuple(scale_models.SHAPES))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--conditions", nargs="+", default=list(CONDITIONS), choices=CONDITIONS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--budget-gguf", type=float, default=0.5)
    parser.add_argument("--budget-bf16", type=float, default=1.0)
    parser.add_argument("--cap-gib", type=float, default=12.0)
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("--keep-caches", action="store_true", help="keep FOLDER/runs")
    args = parser.parse_args()
    args.models = args.models or ["gguf", "bf16", *(["large"] if args.large else [])]
    args.cap_bytes, args.prompt = int(args.cap_gib * GIB), PROMPT
    return args


def build_models(args) -> dict[str, dict]:
    manifests = {}
    for name in args.models:
        room = scale_models.large_room(args.build) if name == "large" else None
        if room and not (args.build / name / "manifest.json").is_file():
            print(f"{name}: not built ({room})")
            continue
        started = time.perf_counter()
        manifests[name] = scale_models.build(args.build, name)
        size = manifests[name]["file_bytes"] / GIB
        print(f"{name}: {manifests[name]['model']} ({size:.2f} GiB, "
              f"{time.perf_counter() - started:.0f} s)")  # fmt: skip
    return manifests


def measure_rates(manifest: dict) -> dict[str, float]:
    """RAM read rate (torch's threads summing 1 GiB) and the disk's O_DIRECT rate over the
    model's files read by the disk tier's reader (this drops their cached pages)."""
    limits = Limits(memcpy_gb_per_s=0.0)
    measure_memory_read(limits, MeasureSettings(copy_bytes=GIB))
    files = [Path(f) for f in manifest["files"]]
    threads = OffloadConfig().disk.io_threads
    return {
        "ram_read_gb_per_s": limits.memory_read_gb_per_s,
        "disk_direct_gb_per_s": common.direct_read_gb_per_s(files, CHUNK_BYTES, threads),
    }


def budget_of(manifest: dict, args) -> float:
    return args.budget_gguf if scale_models.is_gguf(manifest["name"]) else args.budget_bf16


def llm_flags(method: str, manifest: dict, budget_gib: float) -> dict:
    if method == "uva":
        return {"cpu_offload_gb": round(manifest["weight_bytes"] * 1.05 / GIB, 2)}
    if method.startswith("disk-"):
        io = method.removeprefix("disk-")
        return {"cpu_memory_gb": budget_gib, "disk_io": "page-cache" if io == "cache" else io}
    return {}


def conditions_of(method: str, asked: list[str]) -> list[str]:
    if method in LOAD_ONLY:
        return [c for c in asked if c != "cold"]
    if method == "accelerate":  # (no cache of ours to start fresh: its first run is cold)
        return [c for c in asked if c != "first"]
    return list(asked)


def one_run(manifest, method, condition, folders, args) -> dict:
    cache, inductor = folders
    files = [Path(f) for f in manifest["files"]]
    before = measure_rates(manifest)  # around each run: this machine's rates drift with its load
    cached = scale_runs.set_pages(files + sorted(cache.rglob("*")), cold=condition != "warm")
    env = {"OFFLOAD_CACHE_DIR": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(inductor)}
    budget = budget_of(manifest, args)
    record = {"model": manifest["name"], "method": method, "condition": condition,
              "budget_gib": None if method in LOAD_ONLY else budget,
              "cached_bytes_before": cached, "loadavg_before": os.getloadavg(),
              "cache_bytes_before": scale_runs.folder_bytes(cache)}  # fmt: skip
    if method == "serve":
        log = cache.parent / f"serve-{condition}.log"
        flags = ["--cpu-memory-gb", str(budget)]
        record["result"] = scale_runs.run_serve(manifest["model"], flags, env, args, log)
    else:
        spec = {"model": manifest["model"], "method": "accelerate" if method == "accelerate"
                else "llm", "flags": llm_flags(method, manifest, budget), "budget_gib": budget,
                "prompt": args.prompt, "max_tokens": args.max_tokens, "rounds": args.rounds}  # fmt: skip
        record["flags"] = spec["flags"]
        record["result"] = scale_runs.run_child(spec, env, args.timeout_s, args.cap_bytes)
    record["cache_growth_bytes"] = scale_runs.folder_bytes(cache) - record["cache_bytes_before"]
    record["loadavg_after"] = os.getloadavg()
    record["rate_samples"] = [before, measure_rates(manifest)]
    record["rates"] = {k: statistics.mean(r[k] for r in record["rate_samples"]) for k in before}
    return record


def add_figures(record: dict, manifest: dict, reference: dict | None) -> list[dict]:
    """The rows the table shows for a run (a served run: one per N), with their bound."""
    result, rates = record["result"], record["rates"]
    per_token = manifest["stack_bytes"] + manifest["head_bytes"]
    ram_s = per_token / (rates["ram_read_gb_per_s"] * 1e9)
    base = {"peak_rss_bytes": result.get("peak_rss_bytes") or result.get("polled_peak_rss_bytes"),
            "error": result.get("error")}  # fmt: skip
    base["allowed_bytes"] = allowed(record, manifest, result, reference)
    if base["allowed_bytes"] and base["peak_rss_bytes"]:
        base["within_budget"] = base["peak_rss_bytes"] <= base["allowed_bytes"] * SLACK
    if reference and reference is not record:
        ref = reference["result"]
        # (the rounds' tokens, after the background compiles: a first answer may run
        # eagerly where the other's step was ready, and the two forms' bits may differ)
        key = "steady_tokens" if "steady_tokens" in ref and "steady_tokens" in result else "tokens"
        same = (result.get("text") == ref.get("text")) if record["method"] == "serve" else (
            result.get(key) == ref.get(key))  # fmt: skip
        base["same_as_resident"] = same if "tokens" in ref and not result.get("error") else None
    rows = []
    if record["method"] != "serve":
        disk = result.get("disk_read_bytes_per_forward", 0.0)
        row = {**base, "n": 1, "load_s": result.get("load_s"),
               "first_token_wait_s": result.get("first_token_wait_s"),
               "ttft_s": result.get("median_ttft_s"), "tok_s": result.get("median_decode_tok_s"),
               "disk_bytes_per_forward": disk}  # fmt: skip
        rows.append(row)
    for clients in result.get("clients", []):
        good = [r for r in clients["rounds"] if r["tokens_per_s"] > 0]
        counters = [r.get("counters") or {} for r in good]
        forwards = sum(c.get("forwards", 0) for c in counters)
        disk = sum(c.get("disk", 0) for c in counters) / forwards if forwards else 0.0
        ttft = [r["ttft_ms"]["p50"] / 1e3 for r in good if r["ttft_ms"]["p50"] is not None]
        gaps = [r["itl_ms"]["p50"] / 1e3 for r in good if r["itl_ms"]["p50"]]
        n = clients["concurrency"]
        rows.append({**base, "n": n, "load_s": result.get("startup_s"),
                     "first_token_wait_s": None, "disk_bytes_per_forward": disk,
                     "ttft_s": statistics.median(ttft) if ttft else None,
                     # decode: N tokens a step, a step the median gap between a stream's tokens
                     "tok_s": n / statistics.median(gaps) if gaps else None,
                     "wall_tok_s": statistics.median([r["tokens_per_s"] for r in good]) if good else None})  # fmt: skip
    for row in rows:
        disk_s = row["disk_bytes_per_forward"] / (rates["disk_direct_gb_per_s"] * 1e9)
        row["bound_link"] = "disk" if disk_s > ram_s else "ram"
        row["bound_tok_s"] = row["n"] / max(ram_s, disk_s)
        row["of_bound"] = row["tok_s"] / row["bound_tok_s"] if row["tok_s"] else None
    record["rows"] = rows
    return rows


def allowed(record: dict, manifest: dict, result: dict, reference: dict | None) -> int | None:
    """budget + the fixed overhead the run states (`LLM.fixed_overhead`, generate's figures
    line and serve's start line: process, weights outside the stack, tokenizer); where it
    states none: a process's RSS after its imports, measured by the resident run, plus the
    weights outside the stack as stored."""
    if record["budget_gib"] is None:
        return None
    if result.get("stated_overhead_bytes"):
        return int(record["budget_gib"] * GIB + result["stated_overhead_bytes"])
    baseline = result.get("baseline_rss_bytes")
    if baseline is None and reference is not None:
        baseline = reference["result"].get("baseline_rss_bytes")
    if baseline is None:
        return None
    return int(record["budget_gib"] * GIB + baseline + manifest["outside_stack_bytes"])


def fmt(value, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value / scale, spec)


def print_rows(record: dict) -> None:
    for row in record["rows"]:
        method = record["method"] + (f" N={row['n']}" if record["method"] == "serve" else "")
        same = {True: "yes", False: "NO", None: "-"}[row.get("same_as_resident")]
        print(
            f"{record['model']:<10}{method:<13}{record['condition']:<6}"
            f"{fmt(row['peak_rss_bytes'], '.2f', GIB):>7}{fmt(row['allowed_bytes'], '.2f', GIB):>8}"
            f"{fmt(row['load_s'], '.1f'):>7}{fmt(row['first_token_wait_s'], '.1f'):>7}"
            f"{fmt(row['ttft_s'], '.2f'):>7}{fmt(row['tok_s'], '.2f'):>7}"
            f"{fmt(row['bound_tok_s'], '.2f'):>7} {row['bound_link']:<5}"
            f"{fmt(row['of_bound'], '.2f'):>6}{fmt(row['disk_bytes_per_forward'], '.0f', 1e6):>7}"
            f"{fmt(record['cache_growth_bytes'], '.0f', 1e6):>8}{same:>5}"
            f"{record['loadavg_after'][1]:>6.1f}  {row['error'] or ''}",
            flush=True,
        )


HEADER = (f"{'model':<10}{'method':<13}{'pages':<6}{'peak':>7}{'allowed':>8}{'load':>7}"
          f"{'1st':>7}{'TTFT':>7}{'tok/s':>7}{'bound':>7} {'link':<5}{'ratio':>6}"
          f"{'MB/fwd':>7}{'cache+':>8}{'same':>5}{'load':>6}")  # fmt: skip
UNITS = ("(GiB, seconds; the bound in tok/s over the link named, from the rates measured before "
         "and after the run; MB (1e6) read from disk a forward, added to the cache; the 5-minute "
         "load average after the run)")  # fmt: skip


def measure_model(manifest: dict, args, records: list[dict]) -> None:
    print(f"\n{manifest['name']}: budget {budget_of(manifest, args)} GiB\n{HEADER}\n{UNITS}")
    reference = None
    for method in args.methods:
        if method == "accelerate" and scale_models.is_gguf(manifest["name"]):
            continue  # (transformers reads no GGUF as stored: the peer runs bf16 only)
        base = args.build / "runs" / f"{manifest['name']}-{method}"
        shutil.rmtree(base, ignore_errors=True)
        folders = (base / "cache", base / "inductor")
        for path in folders:
            path.mkdir(parents=True)
        for number, condition in enumerate(conditions_of(method, args.conditions)):
            record = one_run(manifest, method, condition, folders, args)
            record["fresh_cache"] = number == 0
            if method == "resident" and reference is None and not record["result"].get("error"):
                reference = record
            add_figures(record, manifest, reference)
            records.append(record)
            print_rows(record)
            (args.build / "scale-partial.json").write_text(json.dumps(records, default=str))
        if not args.keep_caches:
            shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    args = parse_args()
    manifests = build_models(args)
    if args.only_build:
        return
    records: list[dict] = []
    started = os.getloadavg()
    for manifest in manifests.values():
        measure_model(manifest, args, records)
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "prompt": PROMPT,
               "loadavg_start": started, "loadavg_end": os.getloadavg(),
               "models": manifests, "runs": records}  # fmt: skip
    print(f"saved {common.save('scale', torch.device('cpu'), payload)}")


if __name__ == "__main__":
    main()
