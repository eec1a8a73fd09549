"""Greedy decode with the KV cache in host memory vs on the device, side by side in one run.

    python benchmarks/kv_cache.py [--device cpu|cuda] [--batch 4] [--prompt-tokens 512]
                                  [--tokens 32] [--repeats 5] [--model PATH]

Two `LLM` engines of the same model (no weight offloading): one with its static KV cache
on the device, one with `kv_offload=True` (the cache in host memory, a ring of two device
slots refilled with only the positions written so far, new rows written back). Both must
produce the same greedy tokens (checked), so the run also proves the offload exact.

Decode time per step excludes the prefill: it is (a generate of tokens + 1 minus a
generate of 1 new token) / tokens, paired within each round, the engines interleaved
round by round, the median taken. A step is one token for each of the `batch` sequences.

Next to the offloaded figure it prints the KV bytes it moved per step (host -> device
refills plus device -> host write-backs, the engine's counters), what transformers' own
`StaticCache(offloading=True)` would move for the same shape (every offloaded layer's
whole cache, keys and values, to the device and back at every forward), and the bound
max(device-cache step, bytes per step / copy bandwidth), the bandwidth measured for a
plain copy of one layer's cache through the copy engine. On CUDA it also times
transformers' offloaded cache itself, on the device-cache engine's model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

# OpenMP workers that spin between parallel regions starve the CPU copy thread; this must
# be set before torch starts its OpenMP runtime (it is recorded with the results).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common
from decode import copy_bandwidth

from offload.engine.sampling import SamplingParams
from offload.llm.llm import LLM
from offload.memory.kv_shape import kv_shape_of

PROMPT_TEXT = (
    "The history of computing is a story of memory: every machine has had less of the "
    "fast kind than its programs wanted, and much of the craft has been moving data to "
    "where it is needed just before it is needed. "
)
DEVICE = "device cache"
HOST = "host cache (kv_offload)"
HF = "transformers offloading"
KV_KEYS = ("bytes_copied", "bytes_written_back")


def kv_moved(llm: LLM) -> dict[str, int]:
    """The engine's running totals of KV bytes brought to the device and written back
    (summed over generate calls, CUDA graph replays included)."""
    stats = llm.transfer_stats()
    return {
        "bytes_copied": stats.kv_copied_bytes,
        "bytes_written_back": stats.kv_written_back_bytes,
    }


def prompt_ids(tokenizer, batch: int, length: int) -> list[list[int]]:
    """`batch` prompts of exactly `length` token ids, deterministic and distinct: the
    fixed text repeated, tokenized once, and cut at a different offset per sequence (ids
    go straight to the engine, so no round trip through text can change the length)."""
    repeats = 1
    while len(ids := tokenizer(PROMPT_TEXT * repeats).input_ids) < length + batch:
        repeats *= 2
    return [ids[row : row + length] for row in range(batch)]


def timed(fn, device: torch.device):
    """(seconds, result) of one call, the device synchronised before and after."""
    common.synchronize(device)
    started = time.perf_counter()
    result = fn()
    common.synchronize(device)
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=32, help="decode tokens timed")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if min(args.batch, args.prompt_tokens, args.tokens, args.repeats) < 1:
        parser.error("--batch, --prompt-tokens, --tokens and --repeats must be >= 1")

    engines = {
        DEVICE: LLM(args.model, device=device, kv_offload=False),
        HOST: LLM(args.model, device=device, kv_offload=True),
    }
    resident = engines[DEVICE]
    max_cache_len = args.prompt_tokens + args.tokens + 1  # prompt width + max_tokens
    if max_cache_len > resident.max_model_len:
        parser.error(
            f"--prompt-tokens + --tokens + 1 = {max_cache_len} exceeds this model's "
            f"max_model_len ({resident.max_model_len})"
        )
    ids = prompt_ids(resident.tokenizer, args.batch, args.prompt_tokens)

    def params(max_tokens: int) -> SamplingParams:
        # min_tokens = max_tokens masks the end token at every step, exactly what
        # transformers' min_new_tokens does, so the CUDA comparison with its generate is
        # like for like (with ignore_eos alone, an end token would be kept here but
        # masked there).
        return SamplingParams(
            temperature=0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True
        )

    def ours(llm: LLM, max_tokens: int):
        def run() -> list[list[int]]:
            prompts = [{"prompt_token_ids": row} for row in ids]
            outputs = llm.generate(prompts, params(max_tokens))
            return [request.outputs[0].token_ids for request in outputs]

        return run

    runs = {name: (ours(llm, args.tokens + 1), ours(llm, 1)) for name, llm in engines.items()}

    if device.type == "cuda":
        from transformers import StaticCache

        model = resident.model
        input_ids = torch.tensor(ids, device=device)
        attention_mask = torch.ones_like(input_ids)

        def theirs(max_tokens: int):
            def run() -> list[list[int]]:
                cache = StaticCache(
                    config=model.config,
                    max_cache_len=args.prompt_tokens + max_tokens,
                    offloading=True,
                )
                with torch.inference_mode():
                    out = model.generate(
                        input_ids=input_ids,
                        attention_mask=attention_mask,
                        max_new_tokens=max_tokens,
                        min_new_tokens=max_tokens,
                        do_sample=False,
                        past_key_values=cache,
                        pad_token_id=resident.tokenizer.pad_token_id,
                        # Eager: generate would otherwise torch.compile the forward for
                        # any static cache on CUDA (the compile would land in the warm-up).
                        disable_compile=True,
                    )
                return out[:, args.prompt_tokens :].tolist()

            return run

        runs[HF] = (theirs(args.tokens + 1), theirs(1))
    else:
        print(f"{HF}: not timed on CPU (transformers' cache offloading needs CUDA)")

    # One untimed warm-up of each run (both lengths); the long one gives the tokens.
    reference = None
    tokens_equal: dict[str, bool] = {}
    for name, (long_run, short_run) in runs.items():
        tokens = long_run()
        short_run()
        if reference is None:
            reference = tokens
        tokens_equal[name] = tokens == reference
        if name != HF:  # ours must be exact; transformers' result is reported
            assert tokens_equal[name], f"{name}: greedy tokens differ from the device cache"
    assert all(len(row) == args.tokens + 1 for row in reference), "a sequence stopped early"

    # Timed rounds, the runs interleaved so that drift in a shared machine's speed hits
    # them all alike. The KV counters are read around each offloaded call: they are
    # running totals over generate calls, so a call's difference is what it moved.
    step_s: dict[str, list[float]] = {name: [] for name in runs}
    long_s: dict[str, list[float]] = {name: [] for name in runs}
    short_s: dict[str, list[float]] = {name: [] for name in runs}
    kv_long: list[dict[str, int]] = []
    kv_short: list[dict[str, int]] = []
    host = engines[HOST]

    def kv_delta(before: dict[str, int]) -> dict[str, int]:
        after = kv_moved(host)
        return {key: after[key] - before[key] for key in KV_KEYS}

    for _ in range(args.repeats):
        for name, (long_run, short_run) in runs.items():
            before = kv_moved(host)
            seconds_long, tokens = timed(long_run, device)
            if name == HOST:
                kv_long.append(kv_delta(before))
            before = kv_moved(host)
            seconds_short, _ = timed(short_run, device)
            if name == HOST:
                kv_short.append(kv_delta(before))
            if name != HF:
                assert tokens == reference, f"{name}: greedy tokens changed between runs"
            long_s[name].append(seconds_long)
            short_s[name].append(seconds_short)
            step_s[name].append((seconds_long - seconds_short) / args.tokens)

    # KV bytes per decode step: a long call (prefill + `tokens` steps) minus a short call
    # (the prefill alone, which writes the prompt back and brings nothing in) leaves the
    # `tokens` decode steps. The counts are deterministic; all repeats are checked equal.
    assert all(d == kv_long[0] for d in kv_long) and all(d == kv_short[0] for d in kv_short)
    kv_per_step = {key: (kv_long[0][key] - kv_short[0][key]) / args.tokens for key in KV_KEYS}
    moved_per_step = kv_per_step["bytes_copied"] + kv_per_step["bytes_written_back"]

    # What transformers' StaticCache(offloading=True) moves per forward for this shape:
    # each offloaded (full-attention) layer's whole cache to the device and back.
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    config = resident.model.config
    dtype = next(resident.model.parameters()).dtype
    shape = kv_shape_of(config, args.batch, max_cache_len, dtype)
    layers = StaticCache(config=config, max_cache_len=max_cache_len).layers  # lazy: no memory
    offloaded_layers = sum(type(layer) is StaticLayer for layer in layers)
    hf_moved_per_step = 2 * offloaded_layers * shape.layer_bytes

    bandwidth = copy_bandwidth(shape.layer_bytes, device)
    device_step = statistics.median(step_s[DEVICE])
    moved = {DEVICE: 0.0, HOST: moved_per_step, HF: float(hf_moved_per_step)}

    results: dict[str, dict[str, object]] = {}
    for name in (DEVICE, HOST, HF):
        row: dict[str, object] = {"kv_bytes_moved_per_step": moved[name]}
        copy_s = moved[name] / (bandwidth * 1e9)
        row["bound_step_s"] = max(device_step, copy_s)
        row["bound"] = (
            f"max(device {device_step * 1e3:.2f} ms, copy {copy_s * 1e3:.2f} ms at "
            f"{bandwidth:.1f} GB/s)"
        )
        if name in step_s:
            step = statistics.median(step_s[name])
            row.update(
                step_s=step,
                tokens_per_s=args.batch / step,
                ratio_to_device_cache=device_step / step,
                step_s_all=step_s[name],
                long_s=long_s[name],
                short_s=short_s[name],
                tokens_equal_device_cache=tokens_equal[name],
            )
        else:
            row["skipped"] = "transformers' cache offloading needs CUDA"
        results[name] = row
    results[HOST]["kv_per_step"] = kv_per_step
    results[HOST]["kv_long_call"] = kv_long[0]
    results[HOST]["kv_short_call"] = kv_short[0]

    print(
        f"batch {args.batch}, prompt {args.prompt_tokens} tokens, {args.tokens} decode steps, "
        f"{args.repeats} rounds; KV cache {offloaded_layers} layers x "
        f"{shape.layer_bytes / 2**20:.2f} MiB at {max_cache_len} positions"
    )
    print(f"{'run':<26}{'step ms':>9}{'tok/s':>9}{'x device':>10}{'KV moved/step':>15}  bound")
    for name, row in results.items():
        if "step_s" in row:
            figures = (
                f"{row['step_s'] * 1e3:>9.2f}{row['tokens_per_s']:>9.1f}"
                f"{row['ratio_to_device_cache']:>10.2f}"
            )
        else:
            figures = f"{'skipped (needs CUDA)':>28}"
        moved_mib = row["kv_bytes_moved_per_step"] / 2**20
        print(f"{name:<26}{figures}{moved_mib:>11.2f} MiB  {row['bound']}")
    if HF in tokens_equal:
        same = "equal" if tokens_equal[HF] else "DIFFERENT"
        print(f"{HF}: greedy tokens {same} to ours")
    per_position = shape.row_bytes
    print(
        f"host cache: {kv_per_step['bytes_copied'] / 2**20:.2f} MiB brought in + "
        f"{kv_per_step['bytes_written_back'] / 2**20:.3f} MiB written back per step (one "
        f"position of one layer is {per_position} B)"
        + (
            f"; transformers would move {hf_moved_per_step / moved_per_step:.1f}x as much"
            if moved_per_step
            else ""
        )
    )
    path = common.save(
        "kv_cache",
        device,
        {
            "model": args.model or "SmolLM2-135M-Instruct (bundled)",
            "batch": args.batch,
            "prompt_tokens": args.prompt_tokens,
            "tokens": args.tokens,
            "repeats": args.repeats,
            "dtype": str(dtype),
            "max_cache_len": max_cache_len,
            "offloaded_layers": offloaded_layers,
            "layer_bytes": shape.layer_bytes,
            "copy_gb_per_s": bandwidth,
            "runs": results,
        },
    )
    print(f"saved {path}")


if __name__ == "__main__":
    main()
