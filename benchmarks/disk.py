"""Disk tier: decoder layers streamed from the checkpoint's own files, beside its peers and
beside the bounds of this machine, in one run.

    python benchmarks/disk.py [--part warm|cold|all] [--tokens 32] [--rounds 5]
                              [--batches 1 8 32] [--steps 4] [--layers 16] [--cache-dir DIR]

warm: SmolLM2-135M, one chat prompt, greedy decode of `--tokens` tokens: resident
(transformers, fp32), ours with every decoder layer on disk (`cpu_memory_gb=0`, the files
read once first so the page cache holds them) with the default `disk_io` ("auto": a
checkpoint in the page cache is mapped and computed on in place) and with
`disk_io="page-cache"` (reads, copies into the slots), and accelerate's `disk_offload` (a second copy of every weight, one memory-mapped .dat per
tensor, in a temporary folder). Each is loaded once and decodes once untimed (its tokens
must equal the resident run's: checked and recorded), then the timed runs are interleaved
round by round; medians with min/max. Ours report the bytes read (or mapped) per token; accelerate
maps its whole folder at every forward (every weight is offloaded), so that size. The bound
beside ours: max(resident step, bytes read per token / this machine's page-cache read
bandwidth) with the reads overlapping compute (mapped bytes are not copied: the resident
step); their sum beside it, as a read from the page cache is a copy that takes a core and
this machine's cores all compute.

cold: a Llama-shaped checkpoint of random weights (~3.3 GB fp32 by default, shards of
500 MB so layers span files), written once into `--cache-dir` and reused; budget
`cpu_memory_gb=0.75`, `disk_io="direct"`, decoding from token ids. In the same run: the
disk's own sequential O_DIRECT read bandwidth over those files (before every round, as a
virtual disk's speed drifts, one thread and the tier's threads); compute per decode step, from a 2-layer model of the same shapes kept resident (the
step less its layers, plus the median layer time times the number of layers); the decode
step time at each batch after a short prefill; and the bound max(compute, streamed bytes per
step / the faster O_DIRECT bandwidth), target step <= 1.15x bound. Memory: the process RSS (current
and peak) above what it was before loading, and the growth of the checkpoint's pages in the
page cache (mincore), each against budget + staging + 10%; the RSS also holds the weights
that stay on the compute device (here host RAM), which are added to its allowance.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common

from offload.model.default import default_model_path
from offload.offloader.stats import DiskStats, OffloadStats

PROMPT = "Write a short story about a dragon who learns to fly."
PREFETCH = {"offload_group_size": 1, "offload_num_in_group": 1, "offload_prefetch_step": 2}
WARM_TIER = {**PREFETCH, "cpu_memory_gb": 0.0}  # disk_io left to its default ("auto")
WARM_READS = {**WARM_TIER, "disk_io": "page-cache"}
COLD_TIER = {**PREFETCH, "cpu_memory_gb": 0.75, "disk_io": "direct", "read_ahead": 2}
RESIDENT, OURS, ACCELERATE = "resident", "ours, every layer on disk", "accelerate disk_offload"
OURS_READS = "ours, page-cache reads"
# TinyLlama's shapes; 16 layers of fp32 make ~3.3 GB, over 4x the 0.75 GiB budget.
COLD_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SHARD_BYTES = 500 * 10**6  # not a multiple of a layer: layers span shard files
TIER_READ_BYTES = 4 * 2**20  # the least size of the tier's read requests
SLACK = 1.10  # the "+10%" on memory allowances
TARGET_STEP_OVER_BOUND = 1.15
_GIB = 2**30


class TierMissing(Exception):
    """The disk tier has not landed in this checkout: its config keys are unknown."""


def load_disk_tier(folder: Path, config: dict[str, object]):
    """(model, offloader) through the tier's user API, `load_model` on the CPU."""
    from offload.model.loader import load_model

    try:
        model, offloader = load_model(folder, config, device="cpu")
    except ValueError as error:  # the package's ConfigError is a ValueError
        if "unknown offload config key" in str(error):
            raise TierMissing(str(error)) from None
        raise
    # Every configuration here leaves layers on disk: without disk figures, nothing streams.
    if not offloader.stats().disk.num_units:
        raise TierMissing("load_model accepts the disk settings but streams nothing yet")
    return model, offloader


def checkpoint_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def stats_of(offloader) -> OffloadStats:
    return offloader.stats() if offloader is not None else OffloadStats()


def delta(after: OffloadStats, before: OffloadStats) -> DiskStats:
    """What the disk tier moved between two readings."""
    a, b = after.disk, before.disk
    return DiskStats(
        bytes_read=a.bytes_read - b.bytes_read,
        stall_s=a.stall_s - b.stall_s,
        bytes_mapped=a.bytes_mapped - b.bytes_mapped,
    )


# --- warm: SmolLM2, page cache warm ---


@dataclass
class Run:
    model: object
    offloader: object = None
    tokens: torch.Tensor | None = None
    seconds: list[float] = field(default_factory=list)
    before: dict = field(default_factory=dict)


def decode(model, inputs, num_tokens: int) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(
            **inputs, max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False
        )


def load_warm_runs(folder: Path, offload_dir: Path) -> tuple[dict[str, Run], dict[str, str]]:
    """Each configuration loaded once; the one that cannot run yet is named with why."""
    import accelerate
    from transformers import AutoModelForCausalLM

    def resident():
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    runs, skipped = {RESIDENT: Run(resident())}, {}
    common.warm_file_cache(checkpoint_files(folder))
    for name, config in ((OURS, WARM_TIER), (OURS_READS, WARM_READS)):
        try:
            runs[name] = Run(*load_disk_tier(folder, config))
        except TierMissing as error:
            skipped[name] = f"disk tier not in this checkout ({error})"
    model = resident()
    accelerate.disk_offload(model, offload_dir, execution_device=torch.device("cpu"))
    common.warm_file_cache(sorted(offload_dir.iterdir()))  # its page cache warm too
    runs[ACCELERATE] = Run(model)
    return runs, skipped


def run_warm(args) -> dict[str, object]:
    from transformers import AutoTokenizer

    folder = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with tempfile.TemporaryDirectory(prefix="accelerate-offload-") as offload_dir:
        runs, skipped = load_warm_runs(folder, Path(offload_dir))
        for name, run in runs.items():  # the warm-up, whose tokens are checked
            run.tokens = decode(run.model, inputs, args.tokens)
            run.before = stats_of(run.offloader)
            assert torch.equal(run.tokens, runs[RESIDENT].tokens), f"{name}: tokens differ"
        for _ in range(args.rounds):  # interleaved: drift hits every configuration alike
            for run in runs.values():
                started = time.perf_counter()
                decode(run.model, inputs, args.tokens)
                run.seconds.append(time.perf_counter() - started)
        offload_bytes = sum(p.stat().st_size for p in Path(offload_dir).iterdir())
    cached_gb_per_s = common.cached_read_gb_per_s(checkpoint_files(folder))
    results = warm_results(runs, args, offload_bytes, cached_gb_per_s)
    print_warm(results, skipped, cached_gb_per_s)
    return {
        "tokens": args.tokens,
        "rounds": args.rounds,
        "page_cache_read_gb_per_s": cached_gb_per_s,
        "runs": results,
        "skipped": skipped,
    }


def warm_results(runs, args, offload_bytes: int, cached_gb_per_s: float) -> dict[str, dict]:
    reference = runs[RESIDENT].tokens
    num_tokens = args.rounds * args.tokens
    results = {}
    for name, run in runs.items():
        after = stats_of(run.offloader)
        moved = delta(after, run.before)
        read_bytes = moved.bytes_read / num_tokens
        mapped_bytes = moved.bytes_mapped / num_tokens
        if name == ACCELERATE:
            read_bytes = offload_bytes  # np.memmap: every weight is mapped at every forward
        results[name] = {
            "tokens_per_s": args.tokens / statistics.median(run.seconds),
            "tokens_per_s_min_max": [
                args.tokens / max(run.seconds),
                args.tokens / min(run.seconds),
            ],
            "same_tokens_as_resident": bool(torch.equal(run.tokens, reference)),
            "disk_io": after.disk.io,
            "bytes_read_per_token": read_bytes,
            "bytes_mapped_per_token": mapped_bytes,
            "disk_stall_s_per_token": moved.stall_s / num_tokens,
            "disk_read_gb_per_s": after.disk.read_gb_per_s,
            "staging_bytes": after.disk.staging_bytes,
        }
    resident_s = 1 / results[RESIDENT]["tokens_per_s"]
    for name, row in results.items():
        row["ratio_to_resident"] = row["tokens_per_s"] * resident_s
        row["ratio_to_accelerate"] = row["tokens_per_s"] / results[ACCELERATE]["tokens_per_s"]
        # Reads from the page cache are copies made by a core: overlapped with compute on a
        # free core they cost max(compute, read), on the compute cores their sum.
        # Mapped bytes are computed on in place: no copy, so the bound is compute alone.
        read_s = row["bytes_read_per_token"] / (cached_gb_per_s * 1e9)
        ours = name in (OURS, OURS_READS)
        row["bound_step_s"] = max(resident_s, read_s) if ours else None
        row["serial_step_s"] = resident_s + read_s if ours else None
    return results


def print_warm(results: dict[str, dict], skipped: dict[str, str], cached_gb_per_s: float) -> None:
    resident_ms = 1e3 / results[RESIDENT]["tokens_per_s"]
    print(
        f"\nwarm page cache, SmolLM2-135M fp32 (page cache read {cached_gb_per_s:.1f} GB/s)\n"
        f"{'run':<28}{'io':>11}{'tok/s':>8}{'min-max':>14}{'x resident':>12}"
        f"{'x accelerate':>14}{'read/token':>13}{'mapped/token':>14}{'stall/token':>13}  bound"
    )
    for name, row in results.items():
        low, high = row["tokens_per_s_min_max"]
        bound = ""
        if row["bound_step_s"] is not None:
            read_ms = row["bytes_read_per_token"] / (cached_gb_per_s * 1e6)
            bound = (
                f"max(resident {resident_ms:.1f} ms, read {read_ms:.1f} ms) = "
                f"{1 / row['bound_step_s']:.2f} tok/s, sum {1 / row['serial_step_s']:.2f} tok/s"
            )
        print(
            f"{name:<28}{row['disk_io'] or '-':>11}{row['tokens_per_s']:>8.2f}"
            f"{f'{low:.2f}-{high:.2f}':>14}"
            f"{row['ratio_to_resident']:>12.2f}{row['ratio_to_accelerate']:>14.2f}"
            f"{row['bytes_read_per_token'] / 2**20:>9.1f} MiB"
            f"{row['bytes_mapped_per_token'] / 2**20:>10.1f} MiB"
            f"{row['disk_stall_s_per_token'] * 1e3:>10.2f} ms  {bound}"
        )
    for name, why in skipped.items():
        print(f"{name:<28}skipped: {why}")
    if OURS in results:
        row = results[OURS]
        print(
            f"targets: {OURS} (default settings, disk_io {row['disk_io']}) "
            f"{row['ratio_to_accelerate']:.2f}x accelerate (>= 3), "
            f"{row['ratio_to_resident']:.2f}x resident (>= 0.8), same tokens"
        )


# --- cold: a checkpoint several times the budget, O_DIRECT reads ---


def cold_checkpoint(args) -> tuple[Path, list[Path]]:
    """The random Llama checkpoint for these settings, written on first use; its folder
    is named by a hash of its config so that changed settings never reuse a stale one."""
    config = {**COLD_MODEL, "num_hidden_layers": args.layers, "dtype": args.dtype}
    key = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    folder = args.cache_dir / f"llama-random-{key}"
    if not folder.is_dir():
        print(f"writing a random checkpoint into {folder} (once)", flush=True)
    return folder, common.write_random_checkpoint(folder, config, SHARD_BYTES)


class LayerTimer:
    """Wall time of each decoder layer's forward, through forward hooks."""

    def __init__(self, layers: list[torch.nn.Module]):
        self.seconds: list[float] = []
        self._started = 0.0
        for layer in layers:
            layer.register_forward_pre_hook(self._start)
            layer.register_forward_hook(self._stop)

    def _start(self, module, args) -> None:
        self._started = time.perf_counter()

    def _stop(self, module, args, output) -> None:
        self.seconds.append(time.perf_counter() - self._started)


def timed_decode_steps(
    model, batch: int, args, timer: LayerTimer | None = None
) -> list[tuple[float, list[float]]]:
    """(seconds, layer seconds) of each decode step after a prefill of random token ids;
    the next token is the greedy one. Same ids for every model at a given batch."""
    from transformers import DynamicCache

    generator = torch.Generator().manual_seed(batch)
    ids = torch.randint(model.config.vocab_size, (batch, args.prompt_tokens), generator=generator)
    cache = DynamicCache(config=model.config)
    steps = []
    with torch.inference_mode():
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        for _ in range(args.steps):
            next_ids = out.logits[:, -1].argmax(-1, keepdim=True)  # [batch, 1]
            if timer is not None:
                timer.seconds.clear()
            started = time.perf_counter()
            out = model(input_ids=next_ids, cache=cache, use_cache=True, logits_to_keep=1)
            steps.append((time.perf_counter() - started, list(timer.seconds) if timer else []))
    return steps


def parameter_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def measure_compute(config: dict[str, object], args) -> dict[str, object]:
    """Compute per decode step of the full model, from a 2-layer model of its shapes kept
    resident: the step less its layers, plus the median layer time times the layers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    small = {**config, "num_hidden_layers": 2}
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(**small), dtype=getattr(torch, args.dtype)
    ).eval()
    layers = list(model.model.layers)
    timer = LayerTimer(layers)
    per_batch = {}
    for batch in args.batches:
        estimates, layer_times = [], []
        for _ in range(args.rounds):
            for step_s, layer_s in timed_decode_steps(model, batch, args, timer):
                estimates.append(step_s - sum(layer_s) + args.layers * statistics.median(layer_s))
                layer_times.extend(layer_s)
        per_batch[batch] = {
            "compute_s": statistics.median(estimates),
            "layer_s": statistics.median(layer_times),
        }
    layer_bytes = parameter_bytes(layers[0])
    resident_bytes = parameter_bytes(model) - len(layers) * layer_bytes
    return {"per_batch": per_batch, "layer_bytes": layer_bytes, "resident_bytes": resident_bytes}


def memory_snapshot(files: list[Path]) -> dict[str, int]:
    return {
        **common.process_memory_bytes(),
        "checkpoint_cached_bytes": common.cached_file_bytes(files),
        "meminfo_cached_bytes": common.meminfo_cached_bytes(),
    }


def disk_gb_per_s(files: list[Path]) -> dict[str, float]:
    """O_DIRECT sequential read bandwidth over the checkpoint two ways: one thread of large
    reads (the disk's own streaming rate), and the tier's I/O threads with its read size,
    that many reads in flight at once (a virtual disk may serve those faster)."""
    from offload.config import DiskOffloadConfig

    threads = DiskOffloadConfig().io_threads
    return {
        "1 thread, 16 MiB reads": common.direct_read_gb_per_s(files, 16 * 2**20, 1),
        f"{threads} threads, 4 MiB reads": common.direct_read_gb_per_s(
            files, TIER_READ_BYTES, threads
        ),
    }


def stream(folder: Path, files: list[Path], args) -> dict[str, object]:
    """Decode steps of the tier at each batch, rounds interleaved, the disk's bandwidth
    measured before each round, with memory snapshots before and after loading and at
    the end. O_DIRECT reads drop the files' cached pages, so the page-cache growth while
    decoding is summed round by round."""
    common.drop_file_cache(files)
    common.reset_peak_rss()
    before = memory_snapshot(files)
    model, offloader = load_disk_tier(folder, COLD_TIER)
    loaded = memory_snapshot(files)
    totals = {key: {batch: [] for batch in args.batches} for key in ("steps_s", "read", "stall")}
    bandwidths, decode_growth_bytes = [], 0
    for _ in range(args.rounds):
        bandwidths.append(disk_gb_per_s(files))
        cached_bytes = common.cached_file_bytes(files)
        for batch in args.batches:
            start = offloader.stats()
            totals["steps_s"][batch] += [s for s, _ in timed_decode_steps(model, batch, args)]
            end = offloader.stats()
            forwards = args.steps + 1  # the prefill streams every layer too
            moved = delta(end, start)
            totals["read"][batch].append(moved.bytes_read / forwards)
            totals["stall"][batch].append(moved.stall_s / forwards)
        decode_growth_bytes += common.cached_file_bytes(files) - cached_bytes
    final = memory_snapshot(files)
    stats = offloader.stats()
    del model, offloader
    return {
        "steps_s": totals["steps_s"],
        "streamed_bytes_per_step": {b: statistics.mean(v) for b, v in totals["read"].items()},
        "disk_stall_s_per_step": {b: statistics.mean(v) for b, v in totals["stall"].items()},
        "direct_read_gb_per_s": bandwidths,
        "memory": {"before_load": before, "after_load": loaded, "after_decode": final},
        "decode_cached_growth_bytes": decode_growth_bytes,
        "stats": asdict(stats),
    }


def cold_results(streamed: dict, compute: dict, gb_per_s: float, args) -> dict[int, dict]:
    rows = {}
    for batch in args.batches:
        steps = streamed["steps_s"][batch]
        step_s = statistics.median(steps)
        compute_s = compute["per_batch"][batch]["compute_s"]
        read_s = streamed["streamed_bytes_per_step"][batch] / (gb_per_s * 1e9)
        bound_s = max(compute_s, read_s)
        rows[batch] = {
            "step_s": step_s,
            "step_s_min_max": [min(steps), max(steps)],
            "tokens_per_s": batch / step_s,
            "compute_s": compute_s,
            "streamed_bytes_per_step": streamed["streamed_bytes_per_step"][batch],
            "read_s": read_s,
            "bound_step_s": bound_s,
            "step_over_bound": step_s / bound_s,
            "disk_stall_s_per_step": streamed["disk_stall_s_per_step"][batch],
        }
    return rows


def memory_results(streamed: dict, compute: dict) -> dict[str, dict]:
    """RSS above the process before loading, and the checkpoint's page-cache growth, each
    beside its allowance: budget + staging + 10% (the RSS's also holds the weights that
    stay on the compute device, which is host RAM here)."""
    before, loaded, final = (
        streamed["memory"][key] for key in ("before_load", "after_load", "after_decode")
    )
    stats = streamed["stats"]
    # On a CPU the slot ring ("device" staging) is host RAM as well, and the layers read
    # from disk land there: it is the staging ring.
    staging_bytes = stats["disk"]["staging_bytes"] + stats["device_staging_bytes"]
    host_bytes = COLD_TIER["cpu_memory_gb"] * _GIB + staging_bytes
    rss = {
        "after_load_growth_bytes": loaded["rss_bytes"] - before["rss_bytes"],
        "current_growth_bytes": final["rss_bytes"] - before["rss_bytes"],
        "peak_growth_bytes": final["peak_rss_bytes"] - before["rss_bytes"],
        "staging_bytes": staging_bytes,
        "device_resident_weight_bytes": compute["resident_bytes"],
        "allowance_bytes": SLACK * host_bytes + compute["resident_bytes"],
    }
    rss["within"] = rss["peak_growth_bytes"] <= rss["allowance_bytes"]
    cached = "checkpoint_cached_bytes"
    page_cache = {
        "load_growth_bytes": loaded[cached] - before[cached],
        "decode_growth_bytes": streamed["decode_cached_growth_bytes"],
        "growth_bytes": loaded[cached] - before[cached] + streamed["decode_cached_growth_bytes"],
        "allowance_bytes": SLACK * host_bytes,
        "meminfo_cached_delta_bytes": final["meminfo_cached_bytes"]
        - before["meminfo_cached_bytes"],
    }
    page_cache["within"] = page_cache["growth_bytes"] <= page_cache["allowance_bytes"]
    return {"rss": rss, "page_cache": page_cache}


def run_cold(args) -> dict[str, object]:
    folder, files = cold_checkpoint(args)
    config = json.loads((folder / "config.json").read_text())
    compute = measure_compute(config, args)
    result = {
        "checkpoint": str(folder),
        "checkpoint_bytes": sum(path.stat().st_size for path in files),
        "model": config,
        "tier": COLD_TIER,
        "compute": compute,
    }
    try:
        streamed = stream(folder, files, args)
    except TierMissing as error:
        result["direct_read_gb_per_s"] = [disk_gb_per_s(files)]
        result["skipped"] = f"disk tier not in this checkout ({error})"
        print_cold_inputs(result, compute, args)
        return result
    result["direct_read_gb_per_s"] = streamed["direct_read_gb_per_s"]
    # The bound takes the faster way of reading: the disk can give at least that.
    gb_per_s = max(
        statistics.median(measured[way] for measured in streamed["direct_read_gb_per_s"])
        for way in streamed["direct_read_gb_per_s"][0]
    )
    result["bound_gb_per_s"] = gb_per_s
    result["batches"] = cold_results(streamed, compute, gb_per_s, args)
    result["memory"] = memory_results(streamed, compute)
    result["stats"] = streamed["stats"]
    print_cold_inputs(result, compute, args)
    print_cold(result)
    return result


def print_cold_inputs(result: dict, compute: dict, args) -> None:
    mib = 2**20
    print(
        f"\ncold, random Llama {args.layers} layers {args.dtype}: "
        f"{result['checkpoint_bytes'] / 1e9:.2f} GB in {result['checkpoint']}"
    )
    measurements = result["direct_read_gb_per_s"]
    for way in measurements[0]:
        values = ", ".join(f"{measured[way]:.2f}" for measured in measurements)
        print(f"O_DIRECT sequential read, {way}: {values} GB/s")
    per_batch = ", ".join(
        f"batch {batch} {row['compute_s'] * 1e3:.0f} ms (layer {row['layer_s'] * 1e3:.1f} ms)"
        for batch, row in compute["per_batch"].items()
    )
    print(
        f"layer {compute['layer_bytes'] / mib:.0f} MiB, resident weights "
        f"{compute['resident_bytes'] / mib:.0f} MiB; compute per step: {per_batch}"
    )
    if "skipped" in result:
        print(f"streamed runs skipped: {result['skipped']}")
    else:
        print(f"bound: max(compute, streamed / {result['bound_gb_per_s']:.2f} GB/s)")


def print_cold(result: dict) -> None:
    print(
        f"{'batch':>5}{'step ms':>10}{'min-max':>14}{'tok/s':>8}{'compute':>10}"
        f"{'streamed/step':>15}{'read':>10}{'stall':>10}{'bound':>10}  step/bound"
    )
    for batch, row in result["batches"].items():
        low, high = (seconds * 1e3 for seconds in row["step_s_min_max"])
        print(
            f"{batch:>5}{row['step_s'] * 1e3:>10.0f}{f'{low:.0f}-{high:.0f}':>14}"
            f"{row['tokens_per_s']:>8.2f}{row['compute_s'] * 1e3:>7.0f} ms"
            f"{row['streamed_bytes_per_step'] / 2**20:>11.0f} MiB{row['read_s'] * 1e3:>7.0f} ms"
            f"{row['disk_stall_s_per_step'] * 1e3:>7.0f} ms{row['bound_step_s'] * 1e3:>7.0f} ms"
            f"  {row['step_over_bound']:.2f} (target <= {TARGET_STEP_OVER_BOUND})"
        )
    rss, cache = result["memory"]["rss"], result["memory"]["page_cache"]
    mib = 2**20
    print(
        f"RSS above the process before loading: peak {rss['peak_growth_bytes'] / mib:.0f} MiB, "
        f"now {rss['current_growth_bytes'] / mib:.0f} MiB; allowance "
        f"{rss['allowance_bytes'] / mib:.0f} MiB (1.1 x (budget + staging "
        f"{rss['staging_bytes'] / mib:.0f} MiB) + "
        f"{rss['device_resident_weight_bytes'] / mib:.0f} MiB resident weights): "
        f"{'within' if rss['within'] else 'OVER'}\n"
        f"checkpoint pages in the page cache: {cache['load_growth_bytes'] / mib:+.0f} MiB loading, "
        f"{cache['decode_growth_bytes'] / mib:+.0f} MiB decoding; allowance "
        f"{cache['allowance_bytes'] / mib:.0f} MiB: {'within' if cache['within'] else 'OVER'} "
        f"(machine-wide Cached {cache['meminfo_cached_delta_bytes'] / mib:+.0f} MiB)"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("warm", "cold", "all"), default="all")
    parser.add_argument("--tokens", type=int, default=32, help="warm: greedy tokens per decode")
    # A shared 2-core machine varies by +-25% between single decodes: raise for firmer medians.
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=4, help="cold: decode steps per round")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="cold: prefill length")
    parser.add_argument("--layers", type=int, default=16, help="cold: decoder layers")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "offload-benchmarks"
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    settings = {
        key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()
    }
    payload: dict[str, object] = {"settings": settings}
    if args.part in ("warm", "all"):
        payload["warm"] = run_warm(args)
    if args.part in ("cold", "all"):
        payload["cold"] = run_cold(args)
    print(f"saved {common.save('disk', torch.device('cpu'), payload)}")


if __name__ == "__main__":
    main()
