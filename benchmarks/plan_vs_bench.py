"""The planner's predicted decode step beside the step `offload bench` measured, for every
configuration of ours that bench ran (issue 16: within 15% on this machine).

    python benchmarks/plan_vs_bench.py [BENCH_JSON] [--remeasure]

BENCH_JSON (default: the newest benchmarks/results/bench-*.json) gives the model, dtype,
batch sizes, prompt and output lengths and each method's median step. The planner measures
this machine for that workload (once, cached; `--remeasure` measures again), then predicts
each method's layout with its cost model, with budgets that let every layout fit. A ratio
predicted / measured within [0.85, 1.15] meets the target. The bench run and the planner's
measurements come from different processes (and perhaps a different load of the machine):
run both on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common

from offload.model.build import build_empty
from offload.planner import layouts
from offload.planner.choose import Budgets, evaluate
from offload.planner.measure import measure
from offload.planner.shape import shape_of

RESULTS = Path(__file__).parent / "results"
TOLERANCE = 0.15
HUGE = 2**50  # budgets that every layout fits


def layouts_of(shape) -> dict[str, layouts.Layout]:
    """The layout each of bench's methods of ours runs (see offload/bench/ours.py)."""
    return {
        "resident": layouts.resident(shape),
        "prefetch-all": layouts.prefetch(shape, 1, 1, 2, HUGE, "auto"),
        "prefetch-half": layouts.prefetch(shape, 2, 1, 1, HUGE, "auto"),
        "disk": layouts.prefetch(shape, 1, 1, 2, 0, "mmap"),  # the default on a warm cache
        "disk-direct": layouts.prefetch(shape, 1, 1, 2, 0, "direct"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench_json", nargs="?", type=Path)
    parser.add_argument("--remeasure", action="store_true")
    args = parser.parse_args()
    path = args.bench_json or sorted(RESULTS.glob("bench-*.json"))[-1]
    bench = json.loads(path.read_text())
    work = bench["workload"]
    device = torch.device(work["device"])
    model_path = Path(work["path"])
    context_len = work["prompt_len"] + work["output_len"]
    empty = build_empty(model_path, work["dtype"], False)
    shape = shape_of(empty, context_len)
    batches = sorted({row["batch"] for row in bench["records"]})
    measured = measure(
        model_path, shape, device, batches, context_len, remeasure=args.remeasure
    ).measurements
    budgets = Budgets(HUGE, HUGE, HUGE)
    rows = []
    print(f"{path.name}: {work['model']} {work['dtype']} on {device}, context {context_len}")
    print(f"{'method':>14}{'batch':>6}{'measured ms':>13}{'predicted ms':>14}{'ratio':>8}  limit")
    for name, layout in layouts_of(shape).items():
        for row in (r for r in bench["records"] if r["method"] == name):
            batch = row["batch"]
            found = evaluate(shape, measured, budgets, layout, batch, kv_offload=False)
            predicted = found.time.step_s
            ratio = predicted / row["step_s"]
            rows.append(
                {
                    "method": name,
                    "batch": batch,
                    "measured_step_s": row["step_s"],
                    "predicted_step_s": predicted,
                    "ratio": ratio,
                    "limit": found.time.limit,
                    "within": abs(ratio - 1) <= TOLERANCE,
                }
            )
            print(
                f"{name:>14}{batch:>6}{row['step_s'] * 1e3:>13.1f}{predicted * 1e3:>14.1f}"
                f"{ratio:>8.2f}  {found.time.limit}{'' if rows[-1]['within'] else '  OUTSIDE'}"
            )
    within = sum(r["within"] for r in rows)
    print(f"within {TOLERANCE:.0%}: {within} of {len(rows)}")
    payload = {"bench": path.name, "measurements": json.loads(measured.to_json()), "rows": rows}
    print(f"saved {common.save('plan_vs_bench', device, payload)}")


if __name__ == "__main__":
    main()
