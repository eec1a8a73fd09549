"""The CUDA-graph decode step's time against its bound: the bytes a step reads (weights and
KV cache) / the device memory's bandwidth.

    python benchmarks/gpu_decode.py [--shapes llama-3.2-1b llama-3-8b] [--dtype bfloat16]
                                    [--batch-sizes 1] [--tokens 64] [--repeats 5] [--layers N]
    python benchmarks/gpu_decode.py --device cpu --shapes llama-3.2-1b --layers 2 \\
        --dtype float32 --tokens 8 --repeats 2          # smoke test (eager only)

Each shape is an `LLM` with dummy weights (`load_format="dummy"`, a shipped config; with
`--layers` a copy of its config.json with fewer decoder layers), resident on the device.
The bandwidth is a device-to-device copy of a large buffer, bytes read plus written.

A step's time is (a greedy generate of 8 + tokens new tokens - one of 8) / tokens, the two
paired within each round and the median of the rounds taken: load, prefill and capture
cancel. Modes: "graphs" (CUDA-graph replays, the default engine) and "eager" (what
`enforce_eager=True` runs; by default on the same loaded model, with the engine's graph
switch turned off, so each shape is filled once; `--separate-loads` builds a second
`LLM(enforce_eager=True)` instead). The engine's counters check that graphs replayed in
the one and not in the other. "replay ms" is a graph replay alone (`RowGraphs.run`
wrapped here, the device synchronised around it; the capturing call left out), from one
extra generate.

Bytes a step reads: every parameter but the input embedding table (one row per token),
counted once where it is tied to the output head (which reads all of it), plus the static
KV cache, which attention reads whole: 2 x layers x KV heads x head dim x positions x
batch x element size, at the longer generate's cache length.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common

from offload.engine.row_graphs import RowGraphs
from offload.engine.sampling_params import SamplingParams
from offload.llm.llm import LLM
from offload.model.configs import resolve

PROMPT_TOKENS = 16
SHORT = 8  # new tokens of the shorter generate


def log(message: str) -> None:
    print(message, flush=True)


def device_bandwidth(device: torch.device, num_bytes: int, repeats: int = 10) -> dict:
    """GB/s (1e9) of a device-to-device copy of `num_bytes`, bytes read plus written."""
    source = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    seconds = common.median_seconds(lambda: target.copy_(source), device, 3, repeats)
    return {"copy_bytes": num_bytes, "copy_s": seconds, "gb_per_s": 2 * num_bytes / seconds / 1e9}


def model_folder(shape: str, layers: int | None, scratch: Path) -> str:
    """The shape as `LLM` takes it: its name, or with `layers` a folder holding its
    config.json with that many decoder layers (nothing else: no tokenizer, no weights)."""
    if layers is None:
        return shape
    config = json.loads((resolve(shape) / "config.json").read_text())
    config["num_hidden_layers"] = layers
    folder = scratch / f"{Path(shape).name}-{layers}-layers"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return str(folder)


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the parameters a decode step reads: each storage once, the input
    embedding table left out unless the output head is the same tensor."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == embedding.data_ptr()
    seen, total, devices = set(), 0, set()
    for param in model.parameters():
        if param.data_ptr() in seen:
            continue
        seen.add(param.data_ptr())
        devices.add(str(param.device))
        if param.data_ptr() == embedding.data_ptr() and not tied:
            continue
        total += param.numel() * param.element_size()
    return {
        "weight_bytes": total,
        "embedding_bytes": embedding.numel() * embedding.element_size(),
        "tied_embedding": tied,
        "param_devices": sorted(devices),
    }


def kv_bytes(config, batch: int, positions: int, element_size: int) -> int:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * positions * batch * element_size


def prompts_of(batch: int, vocab: int) -> list[dict[str, list[int]]]:
    return [
        {"prompt_token_ids": [(1000 + 7 * row + i) % vocab for i in range(PROMPT_TOKENS)]}
        for row in range(batch)
    ]


def generate_seconds(llm: LLM, prompts, tokens: int, device: torch.device) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    common.synchronize(device)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    common.synchronize(device)
    seconds = time.perf_counter() - started
    lengths = {len(o.outputs[0].token_ids) for o in outputs}
    if lengths != {tokens}:
        raise RuntimeError(f"asked for {tokens} new tokens, got {sorted(lengths)}")
    return seconds


@contextlib.contextmanager
def timed_replays(times: list[float]):
    """`RowGraphs.run` timed, the device synchronised before and after; the call that
    captures (its instance's graph count grows) is left out."""
    original = RowGraphs.run

    def run(self, step, warm_up):
        before = self.num_graphs
        torch.cuda.synchronize()
        started = time.perf_counter()
        logits = original(self, step, warm_up)
        torch.cuda.synchronize()
        if self.num_graphs == before:
            times.append(time.perf_counter() - started)
        return logits

    RowGraphs.run = run
    try:
        yield
    finally:
        RowGraphs.run = original


def measure(llm: LLM, mode: str, batch: int, args, device: torch.device) -> dict:
    """Median step time of `mode` at `batch` (see the module's docstring)."""
    prompts = prompts_of(batch, llm.model.config.vocab_size)
    long = SHORT + args.tokens
    before = llm.transfer_stats()
    generate_seconds(llm, prompts, SHORT, device)  # warm-up
    generate_seconds(llm, prompts, long, device)
    short_s, long_s, steps = [], [], []
    for _ in range(args.repeats):
        short = generate_seconds(llm, prompts, SHORT, device)
        full = generate_seconds(llm, prompts, long, device)
        short_s.append(short)
        long_s.append(full)
        steps.append((full - short) / args.tokens)
    stats = llm.transfer_stats() - before
    row = {
        "step_s": statistics.median(steps),
        "steps_s": steps,
        "short_generate_s": statistics.median(short_s),
        "long_generate_s": statistics.median(long_s),
        "num_graph_replays": stats.num_graph_replays,
        "num_forwards": stats.num_forwards,
        "replay_s": None,
    }
    if mode == "graphs" and device.type == "cuda":
        times: list[float] = []
        with timed_replays(times):
            generate_seconds(llm, prompts, long, device)
        row["replay_s"] = statistics.median(times) if times else None
        row["num_timed_replays"] = len(times)
    replayed = row["num_graph_replays"] > 0
    row["check_ok"] = replayed if mode == "graphs" else not replayed
    return row


def release() -> None:
    """Let what a closed LLM held go (its memory back to the device)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_shape(shape: str, model: str, args, device: torch.device, hbm: float) -> list[dict]:
    """Every mode and batch size of one shape; the LLM(s) closed before returning."""
    rows = []
    element_size = getattr(torch, args.dtype).itemsize
    loads = [["graphs", "eager"]] if not args.separate_loads else [[m] for m in args.modes]
    loads = [[m for m in modes if m in args.modes] for modes in loads]
    for modes in (m for m in loads if m):
        started = time.perf_counter()
        llm = LLM(
            model,
            load_format="dummy",
            dtype=args.dtype,
            device=device,
            enforce_eager="graphs" not in modes,
            max_model_len=PROMPT_TOKENS + SHORT + args.tokens + 8,
            progress=False,
        )
        try:
            load_s = time.perf_counter() - started
            sizes = weight_bytes(llm.model)
            log(
                f"{shape} {args.dtype}: loaded in {load_s:.1f} s, step weights "
                f"{sizes['weight_bytes'] / 1e9:.3f} GB (embedding {sizes['embedding_bytes'] / 1e9:.3f}"
                f" GB, tied {sizes['tied_embedding']}), params on {sizes['param_devices']}"
            )
            for mode in modes:
                if mode == "eager":
                    llm._use_graphs = False  # what enforce_eager=True sets (llm/loading.py)
                    if llm._generator is not None:  # (its core, kept across calls, has graphs)
                        llm._generator.close()
                for batch in args.batch_sizes:
                    kv = kv_bytes(
                        llm.model.config, batch, PROMPT_TOKENS + SHORT + args.tokens, element_size
                    )
                    step_bytes = sizes["weight_bytes"] + kv
                    bound = step_bytes / (hbm * 1e9)
                    row = {
                        "shape": shape,
                        "model": model,
                        "layers": llm.model.config.num_hidden_layers,
                        "dtype": args.dtype,
                        "batch": batch,
                        "mode": mode,
                        "load_s": load_s,
                        **sizes,
                        "kv_bytes": kv,
                        "step_bytes": step_bytes,
                        "bound_s": bound,
                        **measure(llm, mode, batch, args, device),
                    }
                    row["ratio_to_bound"] = row["step_s"] / bound
                    row["achieved_gb_per_s"] = step_bytes / row["step_s"] / 1e9
                    rows.append(row)
                    replay = row["replay_s"]
                    log(
                        f"  {mode} batch {batch}: step {row['step_s'] * 1e3:.3f} ms"
                        + (f", replay {replay * 1e3:.3f} ms" if replay else "")
                        + f", bound {bound * 1e3:.3f} ms, {row['num_graph_replays']} replays"
                        + ("" if row["check_ok"] else "  CHECK FAILED")
                    )
        finally:
            llm.close()
            del llm
            release()
    return rows


def table(rows: list[dict], hbm: float, device: torch.device) -> None:
    log(
        f"\ndecode step vs bound on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), copy bandwidth {hbm:.0f} GB/s"
    )
    head = f"{'shape':<16}{'dtype':<10}{'batch':>6} {'mode':<7}{'step ms':>9}{'replay ms':>10}"
    log(head + f"{'bound ms':>9}{'x bound':>8}{'GB/s':>8}{'replays':>8}  check")
    for row in rows:
        replay = f"{row['replay_s'] * 1e3:>10.3f}" if row["replay_s"] else f"{'-':>10}"
        log(
            f"{row['shape'][:15]:<16}{row['dtype']:<10}{row['batch']:>6} {row['mode']:<7}"
            f"{row['step_s'] * 1e3:>9.3f}{replay}{row['bound_s'] * 1e3:>9.3f}"
            f"{row['ratio_to_bound']:>8.2f}{row['achieved_gb_per_s']:>8.0f}"
            f"{row['num_graph_replays']:>8}  {'ok' if row['check_ok'] else 'FAILED'}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", nargs="+", default=["llama-3.2-1b", "llama-3-8b"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    parser.add_argument(
        "--tokens", type=int, default=64, help="new tokens between the two generates"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, help="decoder layers of every shape (fewer: faster)")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=["graphs", "eager"],
        help="default: both on cuda, eager on cpu",
    )
    parser.add_argument(
        "--separate-loads", action="store_true", help="an LLM(enforce_eager=True) for eager"
    )
    parser.add_argument("--copy-mib", type=int, help="bandwidth copy size (default 1024, cpu 256)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.modes is None:
        args.modes = ["graphs", "eager"] if device.type == "cuda" else ["eager"]
    if args.layers is not None and args.layers < 2:
        parser.error("--layers must be 2 or more (the engine finds a stack of layers)")
    if "graphs" in args.modes and device.type != "cuda":
        parser.error("CUDA graphs need --device cuda")
    copy_mib = args.copy_mib or (1024 if device.type == "cuda" else 256)
    started = time.perf_counter()

    bandwidth = device_bandwidth(device, copy_mib * 2**20)
    hbm = bandwidth["gb_per_s"]
    log(f"device copy of {copy_mib} MiB: {hbm:.0f} GB/s (read + written)")
    rows, errors = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for shape in args.shapes:
            model = model_folder(shape, args.layers, Path(scratch))
            try:
                rows += run_shape(shape, model, args, device, hbm)
            except Exception as error:  # one shape's failure leaves the others their run
                traceback.print_exc()
                errors.append({"shape": shape, "error": f"{type(error).__name__}: {error}"})
                log(f"{shape}: FAILED {type(error).__name__}: {error}")
                release()
    total_s = time.perf_counter() - started
    path = common.save(
        "gpu-decode",
        device,
        {
            "args": vars(args),
            "prompt_tokens": PROMPT_TOKENS,
            "short_tokens": SHORT,
            "bandwidth": bandwidth,
            "rows": rows,
            "errors": errors,
            "total_s": total_s,
        },
    )
    log(f"saved {path} ({total_s:.0f} s in all)")
    table(rows, hbm, device)
    failed = errors or not all(row["check_ok"] for row in rows)
    if failed:
        log(f"FAILED: {len(errors)} shape errors, checks {[r['check_ok'] for r in rows]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
