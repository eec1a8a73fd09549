"""The result on the terminal (a table), as JSON (with the machine and date) and as a PNG:
tokens/s against batch size, one line per method, each distinct bound once, labelled."""

from __future__ import annotations

import functools
import sys
import textwrap
from pathlib import Path
from typing import TextIO

import torch

from offload.bench.machine import save_json
from offload.bench.records import BenchResult, Record
from offload.sizes import format_bytes

_LIMITS = (
    ("memcpy", "memcpy_gb_per_s"),
    ("disk O_DIRECT", "disk_read_gb_per_s"),
    ("page cache", "page_cache_read_gb_per_s"),
    ("host->device pinned", "h2d_pinned_gb_per_s"),
    ("pageable", "h2d_pageable_gb_per_s"),
    ("memory read", "memory_read_gb_per_s"),
)
# (heading, width, the cell's text from a `Record`)
_COLUMNS = (
    ("method", 16, lambda r: r.method),
    ("batch", 6, lambda r: str(r.batch)),
    ("tok/s", 9, lambda r: _rate(r.tokens_per_s)),
    ("min-max", 14, lambda r: f"{_rate(r.tokens_per_s_min)}-{_rate(r.tokens_per_s_max)}"),
    ("step ms", 9, lambda r: _ms(r.step_s)),
    ("bound ms", 9, lambda r: _ms(r.bound_step_s)),
    ("limit", 11, lambda r: r.bound_limit),
    ("step/bound", 11, lambda r: _number(r.step_over_bound, ".2f")),
    ("plan ms", 9, lambda r: _ms(r.predicted_step_s)),
    ("plan/step", 10, lambda r: _number(r.predicted_over_step, ".2f")),
    ("offloaded", 11, lambda r: format_bytes(r.offloaded_bytes)),
    ("moved/fwd", 11, lambda r: format_bytes(r.moved_bytes_per_forward)),
    ("GB/s", 7, lambda r: f"{r.achieved_gb_per_s:.2f}"),
    ("stall ms", 9, lambda r: _ms(r.stall_s_per_step)),
    ("peak dev", 11, lambda r: _bytes(r.peak_device_bytes)),
    ("peak RSS", 11, lambda r: format_bytes(r.peak_rss_bytes)),
    ("of read", 8, lambda r: _number(r.of_read_bound, ".2f")),
    ("same", 5, lambda r: "yes" if r.same_tokens else "NO"),
)


# The default table's columns, in plain words (within 100 columns; `--wide`: all of them)
_NARROW = (
    ("method", 16, lambda r: r.method),
    ("batch", 6, lambda r: str(r.batch)),
    ("tokens/s", 10, lambda r: _rate(r.tokens_per_s)),
    ("step ms", 9, lambda r: _ms(r.step_s)),
    ("best ms", 9, lambda r: _ms(r.bound_step_s)),
    ("x best", 8, lambda r: _number(r.step_over_bound, ".2f")),
    ("moved/step", 12, lambda r: format_bytes(r.moved_bytes_per_forward)),
    ("memory", 12, lambda r: _bytes(r.peak_device_bytes) if r.peak_device_bytes else format_bytes(r.peak_rss_bytes)),
    ("exact", 6, lambda r: "yes" if r.same_tokens else "NO"),
)  # fmt: skip
WIDTH = 100  # the default table's lines fit this many columns


def table(result: BenchResult, wide: bool = False) -> str:
    """The result as lines of text: the workload, the limits, a legend, one row per method
    and batch, the methods skipped with why, and how the planner did. By default in plain
    words within `WIDTH` columns; `wide`: every figure a record has."""
    work = result.workload
    lines = [
        f"{work.model} {work.dtype} on {work.device}: prompt {work.prompt_len}, "
        f"output {work.output_len} tokens, {work.rounds} round(s); "
        f"weights {format_bytes(work.total_bytes)}, {work.num_layers} layers.",
        "Limits measured here: "
        + ", ".join(_limit(name, getattr(result.limits, key)) for name, key in _LIMITS)
        + ".",
    ]
    if wide:
        lines.append(
            f"compute per step: {result.compute.source}; same tokens as "
            f"{result.reference}; tok/s = batch / median decode step; plan: the planner's "
            f"step predicted from rates and compute measured before each run; plan/step: "
            f"the median over rounds of each run's"
        )
    else:
        lines.append(
            f"tokens/s: batch / the median decode step. best ms: the fastest step the "
            f"slowest link allows (weights' bytes over its rate, or the resident compute: "
            f"{result.compute.source}). x best: step / best. moved/step: weight bytes "
            f"brought in per forward. memory: peak device memory (a GPU) or the process's "
            f"peak RSS (a CPU). exact: the same tokens as {result.reference}. --wide shows "
            f"every column and the planner's predictions."
        )
    columns = _COLUMNS if wide else _NARROW
    rows = ["".join(f"{heading:>{width}}" for heading, width, _ in columns)]
    rows += ["".join(f"{cell(r):>{width}}" for _, width, cell in columns) for r in result.records]
    notes = [f"{name}: skipped, {why}" for name, why in result.skipped.items()]
    notes += _read_bound_lines(result)
    notes += _planner_lines(result)
    if wide:
        return "\n".join([*lines, *rows, *notes])
    wrap = functools.partial(textwrap.wrap, width=WIDTH, subsequent_indent="  ")
    return "\n".join([*(t for line in lines for t in wrap(line)), *rows,
                      *(t for note in notes for t in wrap(note))])  # fmt: skip


def _read_bound_lines(result: BenchResult) -> list[str]:
    """On a CPU, each method's fraction of the read bound at batch 1 (weights' bytes over
    the memory read rate: a step reads each weight once)."""
    rows = [r for r in result.records if r.batch == 1 and r.of_read_bound is not None]
    if not rows:
        return []
    floor = result.workload.total_bytes / (result.limits.memory_read_gb_per_s * 1e9)
    fractions = ", ".join(f"{r.method} {r.of_read_bound:.2f}" for r in rows)
    return [
        f"of the read bound at batch 1 ({format_bytes(result.workload.total_bytes)} of weights "
        f"read at {result.limits.memory_read_gb_per_s:.1f} GB/s: {floor * 1e3:.1f} ms a "
        f"step): {fractions}"
    ]


PREDICTION_TOLERANCE = 0.15  # issue 16: the planner's step within 15% of the measured one


def _planner_lines(result: BenchResult) -> list[str]:
    """How well the planner predicted, and the plan against the best hand setting."""
    ratios = [r.predicted_over_step for r in result.records]
    ratios = [ratio for ratio in ratios if ratio is not None]
    lines = []
    if ratios:
        within = sum(abs(ratio - 1) <= PREDICTION_TOLERANCE for ratio in ratios)
        lines.append(
            f"planner: predicted step within {PREDICTION_TOLERANCE:.0%} of the measured one "
            f"for {within} of {len(ratios)} (plan/step {min(ratios):.2f}-{max(ratios):.2f})"
        )
    for row in result.plan_against_hand:
        if row.best_hand is None:
            continue
        lines.append(
            f"plan at batch {row.batch}: {_rate(row.plan_tokens_per_s)} tok/s, "
            f"{row.plan_over_best_hand:.2f}x the best hand setting in its budget "
            f"({row.best_hand}, {_rate(row.best_hand_tokens_per_s)} tok/s; "
            f"median of the rounds' ratios{_spread(row.plan_over_best_hand_rounds)})"
        )
    return lines


def _spread(ratios: list[float] | None) -> str:
    return f", {min(ratios):.2f}-{max(ratios):.2f}" if ratios and len(ratios) > 1 else ""


def save(result: BenchResult, folder: Path, err: TextIO | None = None) -> list[Path]:
    """The JSON (machine and date added) and, where matplotlib is installed, the PNG
    beside it; a one-line notice on `err` (stderr) when the PNG is skipped."""
    device = torch.device(result.workload.device)
    path = save_json(folder, "bench", device, result.to_dict())
    saved = [path]
    try:
        saved.append(plot(result, path.with_suffix(".png")))
    except ImportError:
        print(
            "offload bench: matplotlib is not installed, no PNG (pip install matplotlib)",
            file=err or sys.stderr,
        )
    return saved


def plot(result: BenchResult, path: Path) -> Path:
    """Tokens/s against batch size, one line per method; each distinct bound once, black,
    dashed, on top, labelled with its limit and the methods it bounds (several methods
    share one bound, e.g. the resident compute: drawn once in each method's colour they lay
    on the methods' own lines and could not be seen). Drawn on a figure of its own (no
    pyplot: the caller's backend is left as it is)."""
    from matplotlib import ticker
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 5.5))
    axes = figure.subplots()
    for number, method in enumerate(dict.fromkeys(r.method for r in result.records)):
        rows: list[Record] = [r for r in result.records if r.method == method]
        axes.plot([r.batch for r in rows], [r.tokens_per_s for r in rows], "o-",
                  color=f"C{number % 10}", label=method)  # fmt: skip
    for number, (line, (limit, methods)) in enumerate(bounds_of(result).items()):
        named = ", ".join(methods[:3]) + (f" +{len(methods) - 3} more" if len(methods) > 3 else "")
        label = f"bound, {limit}: {named}"
        axes.plot(*zip(*line, strict=True), ("--", ":", "-.")[number % 3], color="black",
                  linewidth=1.6, zorder=5, label=textwrap.shorten(label, 60))  # fmt: skip
    work = result.workload
    axes.set(xscale="log", yscale="log", xlabel="batch size", ylabel="decode tokens/s")
    axes.set_title(f"{work.model} {work.dtype} on {work.device}")
    axes.xaxis.set_minor_locator(ticker.NullLocator())
    axes.set_xticks(work.batch_sizes, [str(b) for b in work.batch_sizes])
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="x-small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path


def bounds_of(result: BenchResult) -> dict[tuple, tuple[str, list[str]]]:
    """Each distinct bound line (its (batch, tokens/s) points, to 3 significant figures)
    with its limit and the methods it bounds."""
    lines: dict[tuple, tuple[str, list[str]]] = {}
    for method in dict.fromkeys(r.method for r in result.records):
        rows = [r for r in result.records if r.method == method and r.bound_tokens_per_s]
        if not rows:
            continue
        line = tuple((r.batch, float(f"{r.bound_tokens_per_s:.3g}")) for r in rows)
        limits = " / ".join(dict.fromkeys(r.bound_limit for r in rows))
        lines.setdefault(line, (limits, []))[1].append(method)
    return lines


def _rate(per_s: float) -> str:
    """Three significant figures or more, never an exponent (1234, 56.7, 8.91, 0.05)."""
    return f"{per_s:.0f}" if per_s >= 100 else f"{per_s:.1f}" if per_s >= 10 else f"{per_s:.2f}"


def _limit(name: str, gb_per_s: float | None) -> str:
    return f"{name} {gb_per_s:.2f} GB/s" if gb_per_s is not None else f"{name} -"


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1e3:.2f}" if seconds is not None else "-"


def _number(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else "-"


def _bytes(num_bytes: int | None) -> str:
    return format_bytes(num_bytes) if num_bytes is not None else "-"
