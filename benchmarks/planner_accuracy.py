"""How well the planner predicted, over `offload bench` runs: for each run (a JSON under
benchmarks/results/ with predictions), how many of our configurations' predicted steps
were within 15% of the measured ones, the spread of predicted / measured, and the plan
against the best hand setting in its budget.

    python benchmarks/planner_accuracy.py [BENCH_JSON ...]   (default: every run with
                                                              predictions, oldest first)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
TOLERANCE = 0.15


def summary(path: Path) -> str | None:
    result = json.loads(path.read_text())
    ratios = [r.get("predicted_over_step") for r in result["records"]]
    ratios = [ratio for ratio in ratios if ratio is not None]
    if not ratios:
        return None
    within = sum(abs(ratio - 1) <= TOLERANCE for ratio in ratios)
    line = (
        f"{path.name}: {within} of {len(ratios)} within {TOLERANCE:.0%} "
        f"(predicted/measured {min(ratios):.2f}-{max(ratios):.2f})"
    )
    against = [
        f"batch {row['batch']} {row['plan_over_best_hand']:.2f}x {row['best_hand']}"
        for row in result.get("plan_against_hand", [])
        if row["best_hand"]
    ]
    return line + ("; plan vs best hand: " + ", ".join(against) if against else "")


def main(argv: list[str]) -> None:
    paths = [Path(a) for a in argv] or sorted(RESULTS.glob("bench-*.json"))
    lines = [line for line in map(summary, paths) if line is not None]
    print("\n".join(lines) if lines else "no bench run with predictions")


if __name__ == "__main__":
    main(sys.argv[1:])
