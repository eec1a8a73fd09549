"""What an `LLM` leaves behind when it is made, used once and dropped, again and again (what a
server that reloads models does): open files, threads, mappings, read leases and RSS after
each loop, for the disk tier in each I/O mode and for a model held in RAM.

    python benchmarks/leaks.py [--loops 20] [--model PATH]

Each loop: `LLM(model, cpu_memory_gb=0, disk_io=mode)` (every decoder layer streamed from
the checkpoint), one generate, `del`, `gc.collect()`. The bound is flat: from the second
loop on (the first one warms torch's and the allocator's pools), every count must stay as
it was, and RSS may only drift by the allocator's noise (the table prints the spread).
Without `--model` it uses the default model (SmolLM2-135M, converted once).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common

from offload import SamplingParams
from offload.llm.llm import LLM

MODES = ("direct", "page-cache", "mmap", "ram")


def held() -> dict[str, int]:
    """This process's open files, threads, mappings, read leases and RSS, now."""
    pid = str(os.getpid())
    with open("/proc/locks") as locks:
        leases = sum(1 for line in locks if "LEASE" in line and pid in line.split())
    with open("/proc/self/maps") as maps:
        num_maps = sum(1 for _ in maps)
    return {
        "files": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "maps": num_maps,
        "leases": leases,
        "rss_bytes": common.process_memory_bytes()["rss_bytes"],
    }


def loop(model: str, mode: str) -> None:
    extra = {} if mode == "ram" else {"cpu_memory_gb": 0, "disk_io": mode}
    llm = LLM(model, **extra)
    llm.generate(["What is the capital of France?"], SamplingParams(max_tokens=4), use_tqdm=False)
    del llm
    gc.collect()
    for thread in threading.enumerate():  # told to end by the finalizers: let them finish
        if thread.name.startswith("offload-"):
            thread.join(timeout=5)


def _span(later: list[dict[str, int]], key: str) -> str:
    values = [s[key] for s in later]
    low, high = min(values), max(values)
    return f"{low}" if low == high else f"{low}-{high}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", type=int, default=20)
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: SmolLM2)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = parser.parse_args()
    if args.model is None:
        from offload.model.default import default_model_path

        args.model = str(default_model_path())
    results = {}
    print(f"{args.loops} loops per mode of {args.model}; counts after each loop")
    print(
        f"{'mode':<11} {'files':>11} {'threads':>9} {'maps':>11} {'leases':>7}  RSS MiB after loop 2 .. last"
    )
    for mode in args.modes:
        seen = []
        for _ in range(args.loops):
            loop(args.model, mode)
            seen.append(held())
        later = seen[1:]
        rss = [s["rss_bytes"] / 2**20 for s in later]
        flat = {k: len({s[k] for s in later}) == 1 for k in ("files", "threads", "maps", "leases")}
        results[mode] = {"loops": seen, "flat_after_second": flat,
                         "rss_mib_min": min(rss), "rss_mib_max": max(rss)}  # fmt: skip

        span = functools.partial(_span, later)
        print(
            f"{mode:<11} {span('files'):>11} {span('threads'):>9} {span('maps'):>11} "
            f"{span('leases'):>7}  {rss[0]:.0f} .. {rss[-1]:.0f} (min {min(rss):.0f}, max {max(rss):.0f})"
        )
    # PYTHONMALLOC=malloc shows what CPython's own small-object arenas add (docs/benchmarks.md).
    allocator = os.environ.get("PYTHONMALLOC", "pymalloc")
    path = common.save("leaks", torch.device("cpu"), {"model": args.model, "loops": args.loops,
                                                     "python_allocator": allocator,
                                                     "modes": results})  # fmt: skip
    print(f"saved {path}")


if __name__ == "__main__":
    main()
