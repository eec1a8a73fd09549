"""Data parallel (issue 52): `offload serve --data-parallel-size N` against one replica, on
the default model (as stored), `--clients` concurrent streamed chats (greedy, the same
prompts each round), for the served tokens/s (tokens over the wall time of a round, the
median of `--rounds` after a warm-up round) and each replica's CPU seconds over the
timed rounds (its share of this machine's cores: the front pins each replica to its own;
that the answers equal one replica's is `tests/server/test_replicas.py`'s).

    python benchmarks/replicas.py [--sizes 1 2] [--clients 16] [--max-tokens 32] [--rounds 3]

On a machine with fewer cores than replicas x their threads the replicas share cores;
the CPU seconds say how the work spread. Results: benchmarks/results/replicas-cpu-<date>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common
import serve as served
from serve import Workload, default_server, run_clients, running

from offload.probes.host import child_pids, cpu_seconds


def run(size: int, args) -> dict:
    flags = ["--max-num-seqs", str(args.clients)]
    if size > 1:
        flags += ["--data-parallel-size", str(size)]
    server = default_server(None, flags, f"dp{size}")
    work = Workload(served.SERVED_NAME, args.max_tokens, {"ignore_eos": True})
    with running(server):
        engines = child_pids(server.process.pid) if size > 1 else [server.process.pid]
        run_clients(server.url, work, args.clients, 1)  # (warm-up: compiles, first prefills)
        rates = []
        before = [cpu_seconds(pid) for pid in engines]
        walls = []
        for _ in range(args.rounds):
            records, wall = run_clients(server.url, work, args.clients, 1)
            errors = [r.error for r in records if r.error]
            if errors:
                raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
            rates.append(sum(r.completion_tokens for r in records) / wall)
            walls.append(wall)
        cpu = [cpu_seconds(pid) - b for pid, b in zip(engines, before, strict=True)]
    return {
        "replicas": size,
        "tokens_per_s": statistics.median(rates),
        "rounds_tokens_per_s": rates,
        "cpu_s_per_replica": cpu,
        "wall_s": sum(walls),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = [run(size, args) for size in args.sizes]
    one = next((r for r in rows if r["replicas"] == 1), None)
    for row in rows:
        ratio = row["tokens_per_s"] / one["tokens_per_s"] if one else float("nan")
        row["ratio_to_one"] = ratio
        cpu = ", ".join(f"{c:.1f}" for c in row["cpu_s_per_replica"])
        print(
            f"{row['replicas']} replica(s): {row['tokens_per_s']:.1f} tok/s at {args.clients} "
            f"clients (x{ratio:.2f} one replica's); CPU s per replica over "
            f"{row['wall_s']:.1f} s of rounds: {cpu} ({os.cpu_count()} cores here)"
        )
    payload = {"args": vars(args), "rows": rows}
    print(f"saved {common.save('replicas', torch.device('cpu'), payload)}")


if __name__ == "__main__":
    main()
