"""Speculative decoding over the streamed weights (issue 51): tokens/s with and without it.

    python benchmarks/speculative.py [--settings disk resident] [--rounds 3]
                                     [--max-tokens 128] [--k auto|N]

The default model in float32 is the target; each setting runs it without speculation,
with the default model as stored (Q4_1, resident) drafting (`draft`), and with n-gram
prompt lookup (`ngram`), and each of those with a tree of up to 16 guesses (`draft-tree`, `ngram-tree`: --methods),
on two workloads: `chat` (open questions through the chat
template: lookup has little to find) and `rewrite` (a text to copy with small changes:
lookup finds most of it). A chat answer is `--max-tokens` long (`ignore_eos`), a rewrite's
ends at the model's own EOS (at most 200 tokens); greedy, one prompt at a time. One warm-up call per (setting, method), then `--rounds` timed calls of
the whole workload, the methods' calls interleaved; the median tokens/s, the speed-up over the same setting without
speculation, the weight bytes read (disk tier) or copied per output token, the tokens per
forward and the guesses kept. Answers are compared with the run without speculation.

Settings: `disk` (cpu_memory_gb=0, disk_io direct: every layer read from the checkpoint
at every forward; the bound beside it is one token per read of the weights at the rate the
run's reads went: what decoding without speculation can reach), `resident` (the bound:
none; a CPU computes more for more positions).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common

from offload import LLM, SamplingParams
from offload.model.default import default_model_path, gguf_path

SETTINGS = {
    "disk": {"cpu_memory_gb": 0, "disk_io": "direct"},
    "resident": {},
}
TREE_BUDGET = 16  # the -tree methods' tree_budget
TARGETS = {("disk", "draft", "chat"): 2.5, ("disk", "ngram", "rewrite"): 2.0}
_TEXT = (
    "The quik brown fox jumpd over the lazzy dog. It ran thru the feild and into the forrest, were "
    "it found a smal house. Inside the house lived an old man who had a long whit beard and a cat "
    "named Tom. Every morning the old man made tea and red the newspaper while Tom slept by the "
    "fire. In the afternon they walked down to the river, were the old man fished and Tom watched "
    "the birds. When the sun went down they came home, ate there supper and went to bed erly."
)
WORKLOADS = {
    "chat": [
        "What should I see in Paris in two days?",
        "Explain how a bicycle works to a child.",
    ],
    "rewrite": [
        "Correct the spelling in this text and write it out again in full:\n\n" + _TEXT,
        "Keep this text as it is but fix the spelling mistakes:\n\n" + _TEXT.replace("Tom", "Max"),
    ],
}


def _configs(k: str) -> dict[str, dict | None]:
    """The methods' configs; `k` "auto": num_speculative_tokens left out (the engine keeps
    the number of guesses that pays, measured as it runs)."""
    depth = {} if k == "auto" else {"num_speculative_tokens": int(k)}
    draft = {"model": str(gguf_path()), **depth}
    ngram = {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 1, **depth}
    tree = {"tree_budget": max(TREE_BUDGET, int(depth.get("num_speculative_tokens", 0)))}
    return {
        "none": None,
        "draft": draft,
        "ngram": ngram,
        "draft-tree": {**draft, **tree},
        "ngram-tree": {**ngram, **tree},
    }


def _run(llm: LLM, prompts: list[str], params: SamplingParams):
    before = llm.transfer_stats()
    start = time.perf_counter()
    outputs = []
    for prompt in prompts:  # (one at a time: one user, where offloading's bytes weigh most)
        outputs += llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return outputs, seconds, llm.transfer_stats() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--methods", nargs="+", default=["none", "draft", "ngram"])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--k", default="auto", help="num_speculative_tokens, or auto (left out: the default)"
    )
    args = parser.parse_args()
    # Chat answers run to --max-tokens; a rewrite ends where the model ends it (its copy).
    lengths = {"chat": (args.max_tokens, True), "rewrite": (200, False)}
    model = default_model_path()
    weight_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    direct = common.direct_read_gb_per_s(sorted(model.glob("*.safetensors")), 16 << 20, 2)
    print(f"float32 checkpoint {weight_bytes / 2**20:.0f} MiB; O_DIRECT read {direct:.2f} GB/s")
    rows, answers = [], {}
    for setting in args.settings:
        llms = {}
        for method in args.methods:
            extra = dict(SETTINGS[setting])
            if "cpu_memory_gb" in extra:
                extra["offload_folder"] = tempfile.mkdtemp(prefix="spec-bench-")
            config = _configs(args.k)[method]
            llms[method] = LLM(model, dtype="float32", speculative_config=config, **extra)
        for workload in args.workloads:
            prompts = WORKLOADS[workload]
            most, ignore = lengths[workload]
            params = SamplingParams(temperature=0, max_tokens=most, ignore_eos=ignore)
            warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            for llm in llms.values():
                _run(llm, prompts[:1], warm)  # warm-up (compiles, page cache, draft rows)
            # The methods' rounds interleaved: this machine's pace drifts by 10-15% over
            # minutes, which would otherwise fall on one method's rounds.
            times = {method: [] for method in llms}
            last = {}
            for _ in range(args.rounds):
                for method, llm in llms.items():
                    outputs, seconds, moved = _run(llm, prompts, params)
                    times[method].append(seconds)
                    last[method] = (outputs, moved)
            for method in llms:
                outputs, moved = last[method]
                tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                seconds = statistics.median(times[method])
                key = (setting, workload)
                texts = [o.outputs[0].token_ids for o in outputs]
                same = None if method == "none" else answers.get(key) == texts
                if method == "none":
                    answers[key] = texts
                read = moved.disk_read_bytes + moved.weight_copied_bytes
                row = {
                    "setting": setting,
                    "method": method,
                    "workload": workload,
                    "tokens": tokens,
                    "median_s": seconds,
                    "times_s": times[method],
                    "tokens_per_s": tokens / seconds,
                    "forwards": moved.num_forwards,
                    "tokens_per_forward": tokens / max(moved.num_forwards, 1),
                    "weight_bytes_per_token": read / tokens,
                    "guessed": moved.num_spec_draft_tokens,
                    "kept": moved.num_spec_accepted_tokens,
                    "answers_equal_without": same,
                    "disk_read_gb_per_s": moved.disk_read_gb_per_s,
                }
                base = next(
                    (
                        r
                        for r in rows
                        if r["setting"] == setting
                        and r["workload"] == workload
                        and r["method"] == "none"
                    ),
                    None,
                )
                row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"] if base else None
                row["bytes_ratio"] = (
                    base["weight_bytes_per_token"] / row["weight_bytes_per_token"]
                    if base and row["weight_bytes_per_token"]
                    else None
                )
                # One token per read of the weights, at the rate this run's reads ran.
                per_forward = read / max(moved.num_forwards, 1)
                rate = moved.disk_read_gb_per_s * 1e9
                bound = rate / per_forward if setting == "disk" and per_forward else None
                row["bound_without_speculation_tok_s"] = bound
                target = TARGETS.get((setting, method, workload))
                rows.append(row)
                print(
                    f"{setting:8s} {method:5s} {workload:7s} {row['tokens_per_s']:6.2f} tok/s"
                    + (
                        f" (x{row['speedup']:.2f}{f', target >= {target}' if target else ''})"
                        if row["speedup"]
                        else ""
                    )
                    + f"; {row['tokens_per_forward']:.2f} tokens/forward; "
                    f"{row['weight_bytes_per_token'] / 2**20:.0f} MiB read/token"
                    + (f" (x{row['bytes_ratio']:.2f} fewer)" if row["bytes_ratio"] else "")
                    + (f"; kept {row['kept']}/{row['guessed']}" if row["guessed"] else "")
                    + (f"; bound without speculation {bound:.2f} tok/s" if bound else "")
                    + ("" if same is None else f"; answers equal: {same}")
                )
        for llm in llms.values():
            llm.close()
    payload = {
        "args": vars(args),
        "direct_read_gb_per_s": direct,
        "weight_bytes": weight_bytes,
        "rows": rows,
    }
    print(f"saved {common.save('speculative', torch.device('cpu'), payload)}")


if __name__ == "__main__":
    main()
