"""The report of a result: the table, and the PNG when matplotlib is there (a notice and
no PNG when it is not)."""

import io
import sys

import pytest

from offload.bench import report
from offload.bench.records import BenchResult, Compute, Record, RunWorkload
from offload.probes.limits import Limits


def _row(method, batch, tokens_per_s, bound_tokens_per_s, predicted_over_step=None):
    step_s = batch / tokens_per_s
    bound_s = batch / bound_tokens_per_s
    return Record(
        predicted_step_s=step_s * predicted_over_step if predicted_over_step else None,
        predicted_over_step=predicted_over_step,
        method=method,
        label=method,
        is_ours=method != "resident",
        setting={},
        batch=batch,
        tokens_per_s=tokens_per_s,
        tokens_per_s_min=tokens_per_s * 0.9,
        tokens_per_s_max=tokens_per_s * 1.1,
        step_s=step_s,
        step_s_min=step_s,
        step_s_max=step_s,
        prefill_s=step_s,
        round_step_s=[step_s],
        bound_step_s=bound_s,
        bound_limit="memcpy",
        bound_link_s={"memcpy": bound_s},
        bound_tokens_per_s=bound_tokens_per_s,
        step_over_bound=step_s / bound_s,
        compute_s=step_s / 2,
        offloaded_bytes=2**20,
        moved_bytes_per_forward=2**20,
        moved_bytes_per_forward_by_link={"memcpy": 2**20},
        achieved_gb_per_s=2**20 / step_s / 1e9,
        stall_s_per_step=None,
        peak_device_bytes=None,
        peak_rss_bytes=2**30,
        load_s=0.1,
        load_rss_bytes=2**20,
        load_device_bytes=None,
        same_tokens=True,
    )


RESULT = BenchResult(
    workload=RunWorkload(
        model="tiny",
        path="/nowhere/tiny",
        dtype="float32",
        device="cpu",
        prompt_len=4,
        output_len=3,
        rounds=1,
        total_bytes=2**21,
        num_layers=4,
        layer_bytes=[2**19] * 4,
        checkpoint_bytes=2**21,
        batch_sizes=[1, 8],
    ),
    limits=Limits(memcpy_gb_per_s=10.0, disk_read_gb_per_s=2.0, page_cache_read_gb_per_s=5.0),
    compute=Compute("resident step", {1: 0.01, 8: 0.02}),
    planner=None,
    reference="resident",
    skipped={"diffusers": "group offloading with a stream needs a CUDA device"},
    records=[
        _row("resident", 1, 100.0, 100.0),
        _row("resident", 8, 400.0, 400.0),
        _row("prefetch-all", 1, 50.0, 80.0, 1.1),
        _row("prefetch-all", 8, 300.0, 400.0, 0.8),
    ],
    plan_against_hand=[],
)


def test_the_table_has_a_row_per_record_and_the_skipped_methods():
    lines = report.table(RESULT, wide=True).splitlines()
    assert "memcpy 10.00 GB/s" in lines[1] and "host->device pinned -" in lines[1]
    row = next(line for line in lines if line.split()[:2] == ["prefetch-all", "1"])
    assert row.split()[2:4] == ["50.0", "45.0-55.0"]  # tok/s, min-max
    assert row.split()[7] == "1.60"  # step / bound
    assert row.split()[8:10] == ["22.00", "1.10"]  # the planner's step, and over the measured
    assert "diffusers: skipped, group offloading with a stream needs a CUDA device" in lines
    assert lines[-1] == (
        "planner: predicted step within 15% of the measured one for 1 of 2 (plan/step 0.80-1.10)"
    )


def test_the_default_table_fits_100_columns_in_plain_words():
    lines = report.table(RESULT).splitlines()
    assert all(len(line) <= report.WIDTH for line in lines), max(lines, key=len)
    heading = next(line for line in lines if line.split()[:2] == ["method", "batch"])
    assert heading.split() == [
        "method", "batch", "tokens/s", "step", "ms", "best", "ms", "x", "best", "moved/step",
        "memory", "exact",
    ]  # fmt: skip
    row = next(line for line in lines if line.split()[:2] == ["prefetch-all", "1"])
    assert row.split()[2] == "50.0" and row.split()[5] == "1.60"  # tok/s, step / best
    legend = " ".join(lines[: lines.index(heading)])
    assert "x best: step / best." in legend and "--wide shows every column" in legend
    assert "diffusers: skipped, group offloading with a stream needs a CUDA device" in lines


def test_the_png_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    path = report.plot(RESULT, tmp_path / "chart.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_distinct_bound_is_drawn_once_labelled_with_the_methods_it_bounds():
    """Methods sharing a bound (the resident compute) get one line for it: drawn once per
    method in its colour, the bounds lay on the methods' own lines, unseen."""
    points: dict[str, list] = {}
    for r in RESULT.records:
        points.setdefault(r.method, []).append((r.batch, r.bound_tokens_per_s))
    lines = report.bounds_of(RESULT)
    assert len(lines) == len({tuple(p) for p in points.values()}) == 2
    for line, (limit, methods) in lines.items():
        assert limit == "memcpy" and all(tuple(points[m]) == line for m in methods)
    assert sorted(m for _, methods in lines.values() for m in methods) == sorted(points)


def test_without_matplotlib_the_png_is_skipped_with_a_notice(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # its import now fails
    err = io.StringIO()
    saved = report.save(RESULT, tmp_path, err=err)
    assert [path.suffix for path in saved] == [".json"]
    assert err.getvalue().count("\n") == 1 and "matplotlib is not installed" in err.getvalue()
