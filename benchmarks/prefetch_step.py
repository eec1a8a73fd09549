"""Forward step time of a Llama-shaped model with dummy weights: resident vs prefetch with
every decoder layer offloaded, against the bound max(compute, offloaded bytes / link).

    python benchmarks/prefetch_step.py --device cuda --shape llama-3-8b [--seq 1 512 4096]
    python benchmarks/prefetch_step.py --device cpu --shape DIR --dtype float32   # smoke test, DIR/config.json small

The link bandwidth is measured here, for a plain copy of one layer's bytes from an
exact-size pinned buffer (the same buffers the offloader copies from) and, for
comparison, for `Tensor.copy_` from torch's own pinned memory. Targets (GPU): step time
<= 1.05 x bound, achieved copy bandwidth >= 90% of the plain copy. Results go to
benchmarks/results/ with the device name and date.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict
from pathlib import Path

# OpenMP workers that spin between parallel regions starve the CPU copy thread; this must
# be set before torch starts its OpenMP runtime (it is recorded with the results).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
import common

import offload
from offload.memory.host import HostSlab, TensorSpec, should_pin_memory
from offload.model.configs import resolve


def build(shape: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Random weights of the right shapes, made on the device (no checkpoint). `shape` is
    a shipped config (`offload.model.configs`, e.g. llama-3-8b) or a folder with a config.json."""
    config = AutoConfig.from_pretrained(resolve(shape))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator)
        for module in model.modules():  # computed buffers (rotary frequencies): rebuild them
            if any(True for _ in module.buffers(recurse=False)):
                fresh = type(module)(model.config)
                for name, buffer in fresh.named_buffers(recurse=False):
                    getattr(module, name).copy_(buffer)
    return model.eval()


def link_bandwidth(num_bytes: int, device: torch.device) -> dict[str, float]:
    """GB/s of a plain host->device copy of `num_bytes`, from our exact-size pinned slab
    and from torch's caching pinned allocator."""
    pin = should_pin_memory(device)
    slab = HostSlab([TensorSpec((num_bytes,), torch.uint8)], pin_for=device if pin else None)
    torch_pinned = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pin)
    target = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    rates = {}
    for name, source in (("slab", slab.buffer), ("torch_pinned", torch_pinned)):
        seconds = common.median_seconds(
            lambda source=source: target.copy_(source, non_blocking=True), device, 3, 20
        )
        rates[name] = num_bytes / seconds / 1e9
    return rates


def step_time(model, seq: int, device: torch.device, repeats: int) -> float:
    ids = torch.randint(0, model.config.vocab_size, (1, seq), device=device)

    def forward() -> None:
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)

    return common.median_seconds(forward, device, warmup=3, repeats=repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--shape", default="llama-3-8b", help="a shipped config name or a config folder"
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seq", type=int, nargs="+", default=[1, 512, 4096])
    parser.add_argument("--step", type=int, default=2, help="offload_prefetch_step")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)

    model = build(args.shape, device, dtype)
    resident = {seq: step_time(model, seq, device, args.repeats) for seq in args.seq}
    offloader = offload.apply(
        model, {"offload_group_size": 1, "offload_prefetch_step": args.step}, device=device
    )
    stats = offloader.stats()
    link = link_bandwidth(stats.largest_layer_bytes, device)
    offloaded = stats.offloaded_bytes
    rows = {}
    print(
        f"{args.shape} {args.dtype} on {device}: {offloaded / 2**30:.2f} GiB offloaded, "
        f"staging {stats.device_staging_bytes / 2**20:.0f} MiB, "
        f"plain copy {link['slab']:.1f} GB/s (torch pinned {link['torch_pinned']:.1f} GB/s)"
    )
    print(
        f"{'seq':>6}{'resident ms':>13}{'prefetch ms':>13}{'bound ms':>10}{'x bound':>9}{'copy GB/s':>11}{'of plain':>10}"
    )
    for seq in args.seq:
        before = offloader.stats()
        seconds = step_time(model, seq, device, args.repeats)
        after = offloader.stats()
        copied = after.bytes_copied - before.bytes_copied
        copy_s = after.copies.copy_s - before.copies.copy_s
        achieved = copied / copy_s / 1e9 if copy_s else 0.0
        bound = max(resident[seq], offloaded / (link["slab"] * 1e9))
        rows[seq] = {
            "resident_s": resident[seq],
            "prefetch_s": seconds,
            "bound_s": bound,
            "ratio_to_bound": seconds / bound,
            "achieved_copy_gb_per_s": achieved,
            "achieved_of_plain_copy": achieved / link["slab"],
            "stall_s_per_step": (after.copies.stall_s - before.copies.stall_s) / (args.repeats + 3),
        }
        print(
            f"{seq:>6}{resident[seq] * 1e3:>13.2f}{seconds * 1e3:>13.2f}{bound * 1e3:>10.2f}"
            f"{seconds / bound:>9.3f}{achieved:>11.1f}{achieved / link['slab']:>10.2f}"
        )
    path = common.save(
        f"prefetch-step-{Path(args.shape).name}",
        device,
        {
            "shape": args.shape,
            "dtype": args.dtype,
            "prefetch_step": args.step,
            "offloaded_bytes": offloaded,
            "link_gb_per_s": link,
            "stats": asdict(stats),
            "rows": rows,
        },
    )
    print(f"saved {path}")


if __name__ == "__main__":
    main()
