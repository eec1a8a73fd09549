"""Speculative decoding at real size (issue 51): the 2.7 GiB random bfloat16 Llama of
`scale.py` on the disk tier, each setting in a fresh process, for its peak RSS beside the
budget, its time to first token and tokens/s, without speculation, with n-gram lookup and
with the default model as stored (Q4_1, same tokenizer, resident) drafting.

    python benchmarks/speculative_scale.py --build FOLDER [--budget 1.0] [--max-tokens 32]
        [--methods none ngram draft]

`--build FOLDER`: where `scale.py --build` wrote its models (written there if missing).
The target's weights are random: its answers are noise, so a draft of other weights
guesses almost nothing right (the pace turns guessing off) and n-gram lookup finds what a
random model repeats. What this measures is the cost: the draft's memory beside the
budget, and that speculation never makes the streamed model slower than 0.9x. Each
setting: one warm-up answer of 4 tokens, then `--rounds` answers (greedy, `ignore_eos`),
their medians. Results: benchmarks/results/speculative-scale-cpu-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common

PROMPT = "Write a short story about a lighthouse keeper and a storm."


def _config(method: str) -> dict | None:
    from offload.model.default import gguf_path

    return {
        "none": None,
        "ngram": {"method": "ngram"},
        "draft": {"model": str(gguf_path())},
    }[method]


def child(args: argparse.Namespace) -> None:
    """One setting in this process: its figures as one JSON line on stdout."""
    from offload import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        str(args.model), cpu_memory_gb=args.budget, disk_io="direct",
        offload_folder=tempfile.mkdtemp(prefix="spec-scale-"),
        speculative_config=_config(args.method),
    )  # fmt: skip
    load_s = time.perf_counter() - start
    llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    firsts, rates, tokens = [], [], None
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    before = llm.transfer_stats()
    for _ in range(args.rounds):
        stamps: list[float] = []
        llm._on_step = lambda _sequences, stamps=stamps: stamps.append(time.perf_counter())
        begin = time.perf_counter()
        [output] = llm.generate(PROMPT, params, use_tqdm=False)
        end = time.perf_counter()
        llm._on_step = None
        firsts.append(stamps[0] - begin)
        rates.append((args.max_tokens - 1) / (end - stamps[0]))
        tokens = output.outputs[0].token_ids
    moved = llm.transfer_stats() - before
    hwm = _vm_hwm()
    print(
        json.dumps(
            {
                "method": args.method,
                "load_s": load_s,
                "ttft_s": statistics.median(firsts),
                "decode_tokens_per_s": statistics.median(rates),
                "rounds_tokens_per_s": rates,
                "peak_rss_bytes": hwm,
                "fixed_overhead_bytes": llm.fixed_overhead.total_bytes,
                "forwards": moved.num_forwards,
                "disk_read_bytes": moved.disk_read_bytes,
                "disk_read_gb_per_s": moved.disk_read_gb_per_s,
                "guessed": moved.num_spec_draft_tokens,
                "kept": moved.num_spec_accepted_tokens,
                "tokens": list(tokens),
            }
        )
    )
    llm.close()


def _vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", type=Path, required=True)
    parser.add_argument("--budget", type=float, default=1.0, help="cpu_memory_gb")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=["none", "ngram", "draft"])
    parser.add_argument("--child", choices=["none", "ngram", "draft"], help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.method = args.child
        child(args)
        return
    import scale_models

    model = scale_models.build(args.build, "bf16")["model"]
    rows = []
    for method in args.methods:
        command = [
            sys.executable, __file__, "--build", str(args.build), "--child", method,
            "--model", str(model), "--budget", str(args.budget),
            "--max-tokens", str(args.max_tokens), "--rounds", str(args.rounds),
        ]  # fmt: skip
        row = common.child_row(command, method)
        if row is None:
            continue
        rows.append(row)
        allowance = args.budget * 2**30 + row["fixed_overhead_bytes"]
        print(
            f"{method:5s} peak RSS {row['peak_rss_bytes'] / 2**30:.2f} GiB (budget + fixed "
            f"overhead {allowance / 2**30:.2f} GiB); TTFT {row['ttft_s']:.2f} s; "
            f"{row['decode_tokens_per_s']:.3f} tok/s; kept {row['kept']}/{row['guessed']}; "
            f"disk {row['disk_read_gb_per_s']:.2f} GB/s"
        )
    plain = next((r for r in rows if r["method"] == "none"), None)
    for row in rows:
        row["speedup"] = (
            row["decode_tokens_per_s"] / plain["decode_tokens_per_s"] if plain else None
        )
        row["tokens_equal_without"] = plain is not None and row["tokens"] == plain["tokens"]
        if row["method"] != "none" and plain:
            print(
                f"{row['method']}: x{row['speedup']:.2f}, tokens equal: {row['tokens_equal_without']}"
            )
    payload = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "model": str(model),
        "rows": rows,
    }
    print(f"saved {common.save('speculative-scale', torch.device('cpu'), payload)}")


if __name__ == "__main__":
    main()
