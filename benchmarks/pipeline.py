"""Pipeline parallel at real size (issue 52): the 2.7 GiB random bfloat16 Llama of
`scale.py`, with one per-process budget (`--budget`, cpu_memory_gb), run
  - by one process, which keeps what the budget holds in RAM and streams the rest from
    disk (O_DIRECT), and
  - by `--sizes` ranks (pipeline_parallel_size, started by the LLM on this machine), each
    holding its stage under the same budget, resident where its share fits,
each in a fresh process, for tokens/s at `--clients` prompts decoding together, time to
first token, each rank's peak RSS beside its budget + fixed overhead, and each rank's CPU
seconds over the timed rounds (its busy share of the wall time: this machine's cores are
shared by the ranks; with `--threads`, each process's torch threads, OpenMP's workers
waiting passively so that CPU time is work; with `--pin`, each process on a core of its
own, as ranks on hosts of their own would be). With `--serve` the prompts are clients of
the serving engine (`LLM.stream` from one thread each), whose cores keep micro-batches in
flight over the ranks: a size `2x4` is 2 ranks with 4 micro-batches
(`pipeline_micro_batches`). The bound: bytes a token reads (decoder stack + head) over the RAM
read rate (`memory_gb_per_s`), and for the one process also its disk-streamed bytes over
the O_DIRECT rate.

    python benchmarks/pipeline.py --build FOLDER [--budget 1.6] [--sizes 1 2 2x4]
        [--clients 8] [--max-tokens 16] [--rounds 3] [--serve] [--threads N]

Results: benchmarks/results/pipeline-cpu-<date>.json (machine and date in it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common
import scale_runs

from offload.probes.host import cpu_seconds

PROMPTS = [f"Story {i}: the lighthouse keeper saw" for i in range(64)]


def child(args: argparse.Namespace) -> None:
    """One setting in this process: its figures as one JSON line on stdout."""
    from offload import LLM, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)  # (the ranks started here take this count)
    size, _, micro = args.child.partition("x")
    start = time.perf_counter()
    llm = LLM(
        str(args.model), cpu_memory_gb=args.budget, disk_io="direct", max_model_len=256,
        offload_folder=tempfile.mkdtemp(prefix="pp-bench-"), enforce_eager=True,
        pipeline_parallel_size=int(size), pipeline_micro_batches=int(micro) if micro else None,
    )  # fmt: skip
    load_s = time.perf_counter() - start
    prompts = PROMPTS[: args.clients]
    run = _served if args.serve else _generated
    run(llm, prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
    pids = [os.getpid()]
    if llm._pipeline is not None:
        pids += [child.pid for child in llm._pipeline.member.children]
    if args.pin:  # (each rank on a core of its own, as ranks on hosts of their own)
        for index, pid in enumerate(pids):
            for task in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(task), {index % os.cpu_count()})
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    firsts, rates, whole, walls, tokens = [], [], [], [], None
    before, cpu_before = llm.transfer_stats(), [cpu_seconds(pid) for pid in pids]
    pipeline = llm._pipeline
    busy_before = pipeline.busy() if pipeline is not None else None
    for _ in range(args.rounds):
        begin = time.perf_counter()
        tokens, first, end = run(llm, prompts, params)
        firsts.append(first - begin)
        rates.append(len(prompts) * (args.max_tokens - 1) / (end - first))
        whole.append(len(prompts) * args.max_tokens / (end - begin))
        walls.append(end - begin)
    moved = llm.transfer_stats() - before
    stage_busy = None
    if pipeline is not None:  # (each rank's stage computing, of the wall time)
        stage_busy = [
            (b - a) / sum(walls) for a, b in zip(busy_before, pipeline.busy(), strict=True)
        ]
    cpu = [cpu_seconds(pid) - b for pid, b in zip(pids, cpu_before, strict=True)]
    row = {
        "size": args.child,
        "serve": args.serve,
        "threads": torch.get_num_threads(),
        "pinned": args.pin,
        "in_flight": llm._pipeline.most_in_flight if llm._pipeline is not None else 1,
        "load_s": load_s,
        "ttft_s": statistics.median(firsts),
        "decode_tokens_per_s": statistics.median(rates),
        "tokens_per_s": statistics.median(whole),
        "rounds_tokens_per_s": rates,
        "peak_rss_bytes": [scale_runs.status_bytes(pid, "VmHWM") for pid in pids],
        "cpu_s": cpu,
        "busy": [c / sum(walls) / torch.get_num_threads() for c in cpu],
        "stage_busy": stage_busy,
        "fixed_overhead_bytes": llm.fixed_overhead.total_bytes,
        "rank0_layers": len(list(llm.model.model.layers)),
        "forwards": moved.num_forwards,
        "disk_read_bytes": moved.disk_read_bytes,
        "disk_read_gb_per_s": moved.disk_read_gb_per_s,
        "tokens": [list(t) for t in tokens],
    }
    print(json.dumps(row), flush=True)
    llm.close()


def _generated(llm, prompts, params):
    """`generate`'s tokens, the time of its first step that gave tokens, and its end."""
    stamps: list[float] = []
    llm._on_step = lambda _sequences: stamps.append(time.perf_counter())
    outputs = llm.generate(prompts, params, use_tqdm=False)
    end = time.perf_counter()
    llm._on_step = None
    return [o.outputs[0].token_ids for o in outputs], stamps[0], end


def _served(llm, prompts, params):
    """Each prompt streamed from a thread of its own (a client of the serving engine): the
    tokens, the median first token's time, the last answer's end."""
    firsts, tokens = [0.0] * len(prompts), [None] * len(prompts)

    def client(index: int) -> None:
        for output in llm.stream(prompts[index], params):
            firsts[index] = firsts[index] or time.perf_counter()
            tokens[index] = output.outputs[0].token_ids

    common.in_threads(client, len(prompts))
    return tokens, statistics.median(firsts), time.perf_counter()


def _bounds(manifest: dict) -> dict[str, float]:
    """Bytes a token reads (every weight but the embedding: the stack and the head), the
    RAM read rate and the disk's O_DIRECT rate (GB/s), measured now (`scale.py`'s)."""
    import scale

    model = Path(manifest["model"])
    config = json.loads((model / "config.json").read_text())
    total = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    embedding = config["vocab_size"] * config["hidden_size"] * 2
    return {"token_bytes": total - embedding, **scale.measure_rates(manifest)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", type=Path, required=True)
    parser.add_argument("--budget", type=float, default=1.6, help="cpu_memory_gb per process")
    parser.add_argument("--sizes", nargs="+", default=["1", "2"], help="ranks[xmicro-batches]")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve", action="store_true", help="clients of the serving engine")
    parser.add_argument("--threads", type=int, help="torch threads per process")
    parser.add_argument("--pin", action="store_true", help="each process on a core of its own")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    import scale_models

    if args.threads:  # (OpenMP's idle workers sleep: a rank's CPU time is its work)
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

    manifest = scale_models.build(args.build, "bf16")
    model = Path(manifest["model"])
    bounds = _bounds(manifest)
    bound_s = bounds["token_bytes"] / bounds["ram_read_gb_per_s"] / 1e9
    rows = []
    for size in args.sizes:
        command = [
            sys.executable, __file__, "--build", str(args.build), "--child", str(size),
            "--model", str(model), "--budget", str(args.budget), "--clients",
            str(args.clients), "--max-tokens", str(args.max_tokens), "--rounds", str(args.rounds),
        ]  # fmt: skip
        command += ["--serve"] if args.serve else []
        command += ["--threads", str(args.threads)] if args.threads else []
        command += ["--pin"] if args.pin else []
        row = common.child_row(command, f"size {size}")
        if row is None:
            continue
        rows.append(row)
        allowance = args.budget * 2**30 + row["fixed_overhead_bytes"]
        rss = ", ".join(f"{b / 2**30:.2f}" for b in row["peak_rss_bytes"])
        busy = ", ".join(f"{b:.0%}" for b in row["busy"])
        if row["stage_busy"] is not None:
            stages = ", ".join(f"{b:.0%}" for b in row["stage_busy"])
            busy += f"; stages computing {stages} of the time"
        print(
            f"ranks {size} ({row['in_flight']} in flight): {row['tokens_per_s']:.2f} tok/s "
            f"end to end, {row['decode_tokens_per_s']:.2f} decoding, at {args.clients} prompts "
            f"(bound {args.clients / bound_s:.2f}: {bounds['token_bytes'] / 1e9:.2f} GB a "
            f"step at {bounds['ram_read_gb_per_s']:.1f} GB/s); TTFT {row['ttft_s']:.2f} s; peak "
            f"RSS per rank {rss} GiB (allowance {allowance / 2**30:.2f}); CPU busy {busy}; "
            f"disk {row['disk_read_bytes'] / max(row['forwards'], 1) / 1e6:.0f} MB/forward"
        )
    one = next((r for r in rows if r["size"] == "1"), None)
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / one["tokens_per_s"] if one else None
        row["tokens_equal_one_process"] = one is not None and row["tokens"] == one["tokens"]
        if one and row is not one:
            print(
                f"ranks {row['size']}: x{row['speedup']:.2f} one process's tok/s (end to end), tokens "
                f"equal: {row['tokens_equal_one_process']}"
            )
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "bounds": bounds, "rows": rows}
    print(f"saved {common.save('pipeline', torch.device('cpu'), payload)}")


if __name__ == "__main__":
    main()
