"""Greedy decode tokens/s of SmolLM2-135M: resident vs offloaded, side by side in one run.

    python benchmarks/decode.py [--device cpu|cuda] [--tokens 32] [--repeats 5]

Every offloaded run must produce the resident run's tokens (checked). Next to each
figure it prints the bound: for prefetch, the time to move the offloaded bytes once per
token at the copy bandwidth measured for a plain copy of one layer on this machine, next
to the resident step time (the best an overlapped copy can do is max of the two).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

# OpenMP workers that spin between parallel regions starve the CPU copy thread; this must
# be set before torch starts its OpenMP runtime (it is recorded with the results).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common

import offload
from offload.demo import load_pretrained
from offload.memory.copy_engine import make_copy_engine
from offload.memory.host import HostSlab, TensorSpec, should_pin_memory
from offload.model.layers import find_layers

PROMPT = "Write a short story about a dragon who learns to fly."
ALL_LAYERS = {"offload_group_size": 1, "offload_num_in_group": 1}
RUNS = {
    "resident": None,
    "prefetch step 1": {**ALL_LAYERS, "offload_prefetch_step": 1},
    "prefetch step 2": {**ALL_LAYERS, "offload_prefetch_step": 2},
    "prefetch step 3": {**ALL_LAYERS, "offload_prefetch_step": 3},
    "uva all layers": {"cpu_offload_gb": 0.3955},  # the 30 layers: 405 MiB
}


def decode(model, inputs, num_tokens: int) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(
            **inputs, max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False
        )


def copy_bandwidth(num_bytes: int, device: torch.device, repeats: int = 20) -> float:
    """GB/s of the copy engine for one layer-sized copy (pinned host -> device slot)."""
    pin = should_pin_memory(device)
    slab = HostSlab([TensorSpec((num_bytes,), torch.uint8)], pin_for=device if pin else None)
    slot = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    engine = make_copy_engine(device)

    def one() -> None:
        engine.wait(engine.copy(slot, slab.buffer))
        engine.synchronize()

    seconds = common.median_seconds(one, device, warmup=3, repeats=repeats)
    return num_bytes / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)

    # Every configuration is loaded once and the timed runs are interleaved (one run of
    # each per round), so drift in a shared machine's speed hits them all alike.
    setups = {}
    reference = None
    for name, config in RUNS.items():
        model, tokenizer = load_pretrained(None)
        inputs = tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPT}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        ).to(device)
        offloader = None
        if config is None:
            model.to(device)
        else:
            offloader = offload.apply(model, config, device=device)
        tokens = decode(model, inputs, args.tokens)  # also the warm-up
        if reference is None:
            reference = tokens
            layer_bytes = [
                sum(p.numel() * p.element_size() for p in layer.parameters())
                for layer in find_layers(model)
            ]
        assert torch.equal(tokens, reference), f"{name}: tokens differ from the resident run"
        setups[name] = (model, inputs, offloader, offloader.stats() if offloader else {})
    times: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(args.repeats):
        for name, (model, inputs, _, _) in setups.items():
            times[name].append(
                common.median_seconds(
                    lambda m=model, i=inputs: decode(m, i, args.tokens), device, 0, 1
                )
            )
    results: dict[str, dict[str, float]] = {}
    for name, (_, _, offloader, before) in setups.items():
        after = offloader.stats() if offloader else {}
        runs = args.repeats
        results[name] = {
            "tokens_per_s": args.tokens / statistics.median(times[name]),
            "tokens_per_s_min_max": [
                args.tokens / max(times[name]),
                args.tokens / min(times[name]),
            ],
            "offloaded_bytes": offloader.offloaded_bytes if offloader else 0,
            "bytes_copied_per_token": (after.get("bytes_copied", 0) - before.get("bytes_copied", 0))
            / (runs * args.tokens),
            "stall_s_per_token": (after.get("stall_s", 0) - before.get("stall_s", 0))
            / (runs * args.tokens),
            "device_staging_bytes": after.get("device_staging_bytes", 0),
        }

    bandwidth = copy_bandwidth(max(layer_bytes), device)
    resident_step = 1 / results["resident"]["tokens_per_s"]
    print(
        f"{'run':<18}{'tok/s':>8}{'x resident':>12}{'copied/token':>14}{'stall/token':>13}  bound"
    )
    for name, row in results.items():
        ratio = row["tokens_per_s"] * resident_step
        copy_s = row["bytes_copied_per_token"] / (bandwidth * 1e9)
        row["ratio_to_resident"] = ratio
        row["bound_step_s"] = max(resident_step, copy_s)
        bound = f"max(resident {resident_step * 1e3:.1f} ms, copy {copy_s * 1e3:.1f} ms at {bandwidth:.1f} GB/s)"
        if device.type == "cpu" and copy_s:
            # The copy thread needs a core that compute also uses: with every core busy,
            # the best overlap adds the copy's core time spread over all cores.
            cores = torch.get_num_threads()
            row["shared_core_bound_step_s"] = resident_step + copy_s / cores
            bound += f"; shared {cores} cores: {row['shared_core_bound_step_s'] * 1e3:.1f} ms = {resident_step / row['shared_core_bound_step_s']:.2f}x"
        print(
            f"{name:<18}{row['tokens_per_s']:>8.2f}{ratio:>12.2f}"
            f"{row['bytes_copied_per_token'] / 2**20:>11.1f} MiB{row['stall_s_per_token'] * 1e3:>10.2f} ms  {bound}"
        )
    path = common.save(
        "decode",
        device,
        {
            "tokens": args.tokens,
            "repeats": args.repeats,
            "copy_gb_per_s": bandwidth,
            "runs": results,
        },
    )
    print(f"saved {path}")


if __name__ == "__main__":
    main()
