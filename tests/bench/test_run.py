"""A bench run over a tiny Llama: every record field there, our methods give the
reference's tokens, and a method that really differs is caught."""

import dataclasses
import json
import statistics
import sys

import numpy as np
import pytest
import torch
from small_probes import SMALL_PROBES

from offload.bench import Workload, report, run_bench
from offload.bench.ours import PrefetchAll, Resident
from offload.bench.predict import predict_latest, run_probes
from offload.bench.records import BenchResult
from offload.bench.results import ESTIMATED_COMPUTE, RESIDENT_COMPUTE
from offload.bench.workload import prepare
from offload.model.gguf_fast import FastReader
from offload.planner import layouts
from offload.probes.limits import TIER_WAY, measure_limits

RECORD_FIELDS = {
    "method",
    "label",
    "is_ours",
    "setting",
    "batch",
    "tokens_per_s",
    "tokens_per_s_min",
    "tokens_per_s_max",
    "step_s",
    "step_s_min",
    "step_s_max",
    "prefill_s",
    "offloaded_bytes",
    "moved_bytes_per_forward",
    "moved_bytes_per_forward_by_link",
    "achieved_gb_per_s",
    "stall_s_per_step",
    "peak_device_bytes",
    "peak_rss_bytes",
    "load_s",
    "load_rss_bytes",
    "load_device_bytes",
    "same_tokens",
    "compute_s",
    "bound_step_s",
    "bound_limit",
    "bound_link_s",
    "bound_tokens_per_s",
    "step_over_bound",
    "predicted_step_s",
    "predicted_over_step",
    "round_step_s",
    "round_predicted_s",
    "of_read_bound",
}
LIMIT_FIELDS = {
    "memcpy_gb_per_s",
    "disk_read_gb_per_s",
    "page_cache_read_gb_per_s",
    "h2d_pinned_gb_per_s",
    "h2d_pageable_gb_per_s",
    "host_memory_bytes",
    "host_available_bytes",
    "device_memory_bytes",
    "device_free_bytes",
    "disk_read_ways_gb_per_s",
    "disk_busy_read_gb_per_s",
    "memcpy_samples_gb_per_s",
    "forward_copy_samples_gb_per_s",
    "memory_read_gb_per_s",
    "memory_read_samples_gb_per_s",
    "disk_note",
    "planner_note",
}
BATCHES = (1, 2)
ROUNDS = 2
NAMED = ["resident", "uva", "prefetch-all", "disk", "disk-direct", "plan", "accelerate-disk"]


class ShiftedHead(Resident):
    """Resident with the output head's rows rolled by one: every greedy token differs."""

    name = "shifted-head"
    label = "resident with a broken head (test only)"

    def load(self) -> None:
        super().load()
        head = self.model.get_output_embeddings().weight
        head.data = head.data.roll(1, dims=0)


class FailingPeer(Resident):
    """A peer whose decode fails: it is skipped with why, the others go on."""

    name = "failing-peer"

    def run(self, ids):
        raise RuntimeError("no kernel image is available\nfor this device")


class FailingOurs(PrefetchAll):
    """One of ours that fails to load: the bench stops with the error, never hides it."""

    name = "failing-ours"

    def load(self) -> None:
        raise RuntimeError("our bug")


@pytest.fixture(scope="module")
def result(tiny_llama_path):
    workload = Workload(
        model=str(tiny_llama_path),
        device="cpu",
        batch_sizes=BATCHES,
        prompt_len=4,
        output_len=3,
        rounds=ROUNDS,
    )
    return run_bench(
        workload, [*NAMED, FailingPeer, ShiftedHead], progress=False, settings=SMALL_PROBES
    )


def fields_of(record) -> set[str]:
    return {field.name for field in dataclasses.fields(record)}


def _rows(result, method):
    return [row for row in result.records if row.method == method]


def test_one_record_per_method_and_batch_with_every_field(result):
    pairs = [(row.method, row.batch) for row in result.records]
    methods = [*NAMED, "shifted-head"]  # the failing peer has no record
    assert pairs == [(method, batch) for method in methods for batch in BATCHES]
    for row in result.records:
        assert fields_of(row) == RECORD_FIELDS
        assert row.tokens_per_s > 0 and row.step_s > 0
        assert row.tokens_per_s_min <= row.tokens_per_s_max
        assert row.peak_device_bytes is None  # on a CPU
    assert fields_of(result.limits) == LIMIT_FIELDS
    # The memory copy before loading and before each round; the copies between a forward's
    # layers before and after each run of a method that copies layers in (prefetch-all,
    # and the plan where it chose prefetching).
    copies = result.limits.memcpy_samples_gb_per_s
    assert len(copies) == 1 + ROUNDS
    assert result.limits.memcpy_gb_per_s == statistics.median(copies)
    [plan] = {r.setting["chosen"] for r in _rows(result, "plan")}
    copying = 1 + ("prefetch" in plan)
    forward = result.limits.forward_copy_samples_gb_per_s
    assert len(forward) == 2 * copying * len(BATCHES) * ROUNDS and min(forward) > 0
    # The disk before loading, before each round, and before and after each run of
    # disk-direct.
    ways = result.limits.disk_read_ways_gb_per_s
    expected = 1 + ROUNDS + 2 * len(BATCHES) * ROUNDS
    assert len(ways) == 2 and all(len(measured) == expected for measured in ways.values())
    assert len(result.limits.disk_busy_read_gb_per_s) == expected
    assert result.compute.source == RESIDENT_COMPUTE
    assert result.reference == "resident"


def test_on_a_cpu_each_run_is_set_against_the_read_bound(result):
    """The memory read rate, measured before each run; each record's fraction of the read
    bound (weights' bytes over that rate, over its step), in the table for batch 1."""
    limits = result.limits
    assert len(limits.memory_read_samples_gb_per_s) > len(result.records)
    assert limits.memory_read_gb_per_s == statistics.median(limits.memory_read_samples_gb_per_s)
    floor = result.workload.total_bytes / (limits.memory_read_gb_per_s * 1e9)
    for row in result.records:
        assert row.of_read_bound == pytest.approx(floor / row.step_s)
    line = next(t for t in report.table(result, wide=True).split("\n") if "read bound" in t)
    assert f"resident {_rows(result, 'resident')[0].of_read_bound:.2f}" in line


def test_ours_give_the_reference_tokens_and_a_broken_method_does_not(result):
    for method in ("prefetch-all", "disk", "disk-direct", "accelerate-disk"):
        assert [row.same_tokens for row in _rows(result, method)] == [True, True], method
    assert [row.same_tokens for row in _rows(result, "shifted-head")] == [False, False]


def test_ours_move_bytes_and_the_bound_uses_them(result):
    layers_bytes = sum(result.workload.layer_bytes)
    for row in _rows(result, "prefetch-all"):
        assert row.offloaded_bytes == layers_bytes
        assert row.moved_bytes_per_forward_by_link["memcpy"] == pytest.approx(layers_bytes)
        assert row.stall_s_per_step is not None
    for row in _rows(result, "disk-direct"):  # read from the checkpoint around the cache
        assert row.setting["disk_io_chosen"] == "direct"
        assert row.moved_bytes_per_forward_by_link["disk"] > 0
    for row in _rows(result, "disk"):  # the default, on a checkpoint just written: read
        # through the cache (save_pretrained leaves weights off 64 bytes: never mapped)
        assert row.setting["disk_io_chosen"] == "page-cache"
        assert row.moved_bytes_per_forward_by_link["page_cache"] > 0
    for row in _rows(result, "accelerate-disk"):  # every weight, every forward
        total = result.workload.total_bytes
        assert row.moved_bytes_per_forward_by_link == {"page_cache": pytest.approx(total)}
    for row in result.records:
        assert row.bound_step_s >= row.compute_s > 0
        assert row.step_over_bound == pytest.approx(row.step_s / row.bound_step_s)


def test_ours_and_resident_carry_the_planners_prediction_and_peers_do_not(result):
    planner = result.planner
    assert planner.batch_sizes == list(BATCHES)
    forward = result.limits.forward_copy_samples_gb_per_s
    assert planner.link_gb_per_s == statistics.median(forward)
    # The planner's disk rate is the disk tier's own way of reading, not the faster way.
    tier_reads = result.limits.disk_read_ways_gb_per_s[TIER_WAY]
    assert planner.disk_gb_per_s == statistics.median(tier_reads)
    assert all(layer > 0 for layer in planner.layer_s)
    for row in result.records:
        predicted = row.predicted_step_s
        if row.method == "accelerate-disk":  # not a layout of the planner's
            assert predicted is None and row.predicted_over_step is None
            assert row.round_predicted_s == []
            continue
        # One prediction per round, each set against that round's run.
        paired = list(zip(row.round_predicted_s, row.round_step_s, strict=True))
        assert len(paired) == ROUNDS
        assert predicted > 0
        assert predicted == pytest.approx(statistics.median(p for p, _ in paired))
        assert row.predicted_over_step == pytest.approx(statistics.median(p / s for p, s in paired))


def test_predictions_of_one_moment_order_the_layouts_as_a_cpu_runs_them(tiny_llama_path):
    """From the same timing of compute and the same rates: a CPU's copies take compute's
    cores; the mapped disk tier costs nothing; O_DIRECT reads of these small layers hide
    behind compute."""
    prepared = prepare(Workload(model=str(tiny_llama_path), device="cpu", batch_sizes=BATCHES))
    prepared = dataclasses.replace(prepared, settings=SMALL_PROBES)
    inputs = run_probes(prepared)
    limits = measure_limits(prepared.device, prepared.files, SMALL_PROBES, inputs.layer_reads)
    shape = inputs.shape
    direct = layouts.prefetch(shape, 1, 1, 1, host_budget_bytes=0, disk_io="direct")
    mapped = layouts.prefetch(shape, 1, 1, 1, host_budget_bytes=0, disk_io="mmap")
    for batch in BATCHES:
        inputs.time_now(batch)
        resident = layouts.resident(shape)
        step = {"resident": predict_latest(inputs, limits, resident, batch, reads_page_cache=False)}
        for name, layout in [
            ("prefetch-all", PrefetchAll(prepared).layout(shape)),
            ("mapped", mapped),
            ("direct", direct),
        ]:
            step[name] = predict_latest(inputs, limits, layout, batch, reads_page_cache=False)
        assert step["prefetch-all"] > step["resident"] > 0
        assert step["mapped"] == pytest.approx(step["resident"])
        assert step["direct"] >= step["resident"] * (1 - 1e-9)  # sums in another order
    assert len(inputs.layer_s[BATCHES[0]]) == 1  # timed once per prediction, not per layout


def test_bench_times_compute_as_its_methods_decode_and_rates_around_each_run(
    tiny_llama_path, monkeypatch
):
    """Compute is timed through `generate` (the loop every method runs); a CPU's copies go
    at the rate measured between a forward's layers; and a rate is the median of its last
    three measurements: one dip does not move the prediction."""
    from offload.bench import predict

    prepared = prepare(Workload(model=str(tiny_llama_path), device="cpu", batch_sizes=(2,)))
    prepared = dataclasses.replace(prepared, settings=SMALL_PROBES)
    inputs = run_probes(prepared)
    limits = measure_limits(prepared.device, prepared.files, SMALL_PROBES, inputs.layer_reads)
    calls = []
    decode = predict.greedy_decode
    monkeypatch.setattr(
        predict,
        "greedy_decode",
        lambda model, ids, *a: calls.append(ids.shape) or decode(model, ids, *a),
    )
    inputs.time_now(2)
    assert calls and all(shape == (2, prepared.workload.prompt_len) for shape in calls)
    layout = PrefetchAll(prepared).layout(inputs.shape)

    def predicted(copies):
        limits.forward_copy_samples_gb_per_s = copies
        return predict_latest(inputs, limits, layout, 2, reads_page_cache=False)

    steady = predicted([1.0, 1.0, 1.0])
    limits.memcpy_samples_gb_per_s = [50.0]  # a plain memory copy: not the link's rate
    assert predicted([1.0, 1.0, 1.0]) == steady
    assert predicted([50.0, 1.0, 50.0, 1.0, 1.0]) == steady  # an old rate and one spike
    assert predicted([1.0, 50.0, 1.0]) == steady
    assert predicted([1.0, 1.0, 50.0]) == steady  # the last one alone would say 50
    assert predicted([1.0, 50.0, 50.0]) < steady  # the copy really got faster


def test_the_plan_runs_beside_the_hand_settings_that_fit_its_budget(result):
    [setting] = {json.dumps(r.setting) for r in _rows(result, "plan")}
    setting = json.loads(setting)
    assert setting["chosen"] and setting["predicted_step_s"] > 0 and setting["config"]
    assert all(row.same_tokens for row in _rows(result, "plan"))
    rows = result.plan_against_hand
    assert [row.batch for row in rows] == list(BATCHES)
    for row in rows:
        # Resident does not fit a device budget that holds all but half the layers; UVA
        # of half the layers does (the slots of the others take more than one layer here).
        assert "uva" in row.fitting and "resident" not in row.fitting
        assert "plan" not in row.fitting and "accelerate-disk" not in row.fitting
        at = {r.method: r.tokens_per_s for r in result.records if r.batch == row.batch}
        assert row.best_hand_tokens_per_s == max(at[m] for m in row.fitting)
        steps = {r.method: r.round_step_s for r in result.records if r.batch == row.batch}
        paired = list(zip(steps[row.best_hand], steps["plan"], strict=True))
        assert len(paired) == ROUNDS
        assert row.plan_over_best_hand_rounds == pytest.approx([h / p for h, p in paired])
        assert row.plan_over_best_hand == pytest.approx(statistics.median(h / p for h, p in paired))
    lines = report.table(result).splitlines()
    assert any(line.startswith("planner: predicted step within 15%") for line in lines)
    assert sum(line.startswith("plan at batch") for line in lines) == len(BATCHES)


def test_the_result_is_json_with_the_machine_and_date(result, tmp_path):
    saved = report.save(result, tmp_path)
    loaded = json.loads(saved[0].read_text())
    assert {"date", "torch", "cpu_model"} <= set(loaded["machine"])
    assert set(loaded["records"][0]) == RECORD_FIELDS
    lines = report.table(BenchResult.from_dict(loaded)).splitlines()
    assert any(line.split()[:2] == ["shifted-head", "1"] and line.endswith("NO") for line in lines)


def test_a_result_saved_with_the_old_notes_reads_back_into_their_fields(result, tmp_path):
    """Results written before the notes were fields ("notes": {"disk": ..., "planner":
    ...}) still load, their notes in `disk_note` and `planner_note`."""
    loaded = json.loads(report.save(result, tmp_path)[0].read_text())
    limits = loaded["limits"]
    del limits["disk_note"], limits["planner_note"]
    limits["notes"] = {"disk": "O_DIRECT reads failed: EINVAL", "planner": "no plan"}
    old = BenchResult.from_dict(loaded).limits
    assert (old.disk_note, old.planner_note) == ("O_DIRECT reads failed: EINVAL", "no plan")


def test_a_failing_peer_is_skipped_with_why_and_ours_are_not(result, tiny_llama_path):
    assert result.skipped == {
        "failing-peer": "failed in its warm-up: RuntimeError: no kernel image is available for "
        "this device"
    }
    workload = Workload(model=str(tiny_llama_path), device="cpu", batch_sizes=(1,), rounds=1)
    with pytest.raises(RuntimeError, match="our bug"):
        run_bench(workload, ["resident", FailingOurs], progress=False, settings=SMALL_PROBES)


def test_without_resident_compute_is_estimated_and_ours_are_the_reference(tiny_llama_path):
    workload = Workload(
        model=str(tiny_llama_path), device="cpu", batch_sizes=(1,), output_len=2, rounds=1
    )
    result = run_bench(workload, ["prefetch-half"], progress=False, settings=SMALL_PROBES)
    assert result.reference == "prefetch-half"
    assert result.compute.source == ESTIMATED_COMPUTE
    [row] = result.records
    assert row.same_tokens is True and row.compute_s > 0


def test_the_llm_engine_is_a_method_timed_where_it_picks_each_token(tiny_llama_path):
    """`llm`: our `LLM` engine (its own decode loop, not `generate`): the reference's
    tokens, one timed step per token after the first, for each batch size."""
    workload = Workload(
        model=str(tiny_llama_path), device="cpu", batch_sizes=(1, 3), output_len=5, rounds=2
    )
    result = run_bench(workload, ["resident", "llm"], progress=False, settings=SMALL_PROBES)
    rows = _rows(result, "llm")
    assert [row.batch for row in rows] == [1, 3]
    for row in rows:
        assert row.same_tokens is True and row.step_s > 0 and row.prefill_s > 0
        assert row.tokens_per_s == pytest.approx(row.batch / row.step_s)
        assert row.of_read_bound is not None


def test_diffusers_is_skipped_on_a_cpu_with_why(tiny_llama_path):
    workload = Workload(
        model=str(tiny_llama_path), device="cpu", batch_sizes=(1,), output_len=2, rounds=1
    )
    result = run_bench(workload, ["resident", "diffusers"], progress=False, settings=SMALL_PROBES)
    assert "needs a CUDA device" in result.skipped["diffusers"]
    assert [row.method for row in result.records] == ["resident"]


def test_the_default_gguf_as_stored_runs_ours_and_says_why_the_peers_do_not(monkeypatch):
    """--quantization gguf: resident and the disk tier run the stored weights (the disk
    reads their stored bytes, not float32's); transformers' peers cannot read them, and
    llama.cpp without llama-cpp-python installed is skipped with how to install it."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # (as if not installed)
    workload = Workload(quantization="gguf", device="cpu", batch_sizes=(1,), output_len=2, rounds=1)
    methods = ["resident", "disk-direct", "accelerate-disk", "llama-cpp"]
    result = run_bench(workload, methods, progress=False, settings=SMALL_PROBES)
    assert result.workload.model.endswith("Q4_1.gguf as stored")
    assert result.workload.quantization == "gguf"
    assert [row.method for row in result.records] == ["resident", "disk-direct"]
    disk = result.records[1]
    assert disk.same_tokens is True
    assert 0 < disk.moved_bytes_per_forward_by_link["disk"] < 70 * 2**20  # (float32: 405 MiB)
    assert "from_pretrained reads no offload folder" in result.skipped["accelerate-disk"]
    assert "pip install llama-cpp-python" in result.skipped["llama-cpp"]


def test_llama_cpp_reads_the_bytes_ours_read(tmp_path, monkeypatch):
    """Against our float32 run llama.cpp gets an F32 GGUF of the same weights (each tensor
    the `gguf` reference's de-quantized values, the same names and settings, written once);
    against our run as stored, the GGUF as stored."""
    import types

    import gguf

    from offload.bench.llama_cpp import LlamaCpp, write_f32
    from offload.model.default import gguf_path
    from tests import zoo

    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "cut.gguf"
    zoo.save_cut_gguf(gguf_path(), source, layers=1)
    for quantization, expected in ((None, tmp_path / "cache" / "cut.F32.gguf"), ("gguf", source)):
        workload = types.SimpleNamespace(quantization=quantization)
        method = LlamaCpp(types.SimpleNamespace(gguf=source, workload=workload, device="cpu"))
        assert method.gguf_file() == expected
    written = write_f32(source)
    assert written == tmp_path / "cache" / "cut.F32.gguf"
    assert write_f32(source).stat().st_mtime_ns == written.stat().st_mtime_ns  # (once)
    stored, f32 = FastReader(source), FastReader(written)
    assert [t.name for t in f32.tensors] == [t.name for t in stored.tensors]
    assert {t.tensor_type for t in f32.tensors} == {gguf.GGMLQuantizationType.F32}
    assert {t.tensor_type for t in stored.tensors} != {gguf.GGMLQuantizationType.F32}
    for theirs, ours in zip(stored.tensors, f32.tensors, strict=True):
        values = gguf.quants.dequantize(theirs.data, theirs.tensor_type)
        assert np.array_equal(np.asarray(ours.data).reshape(values.shape), values), theirs.name
    for name in ("llama.block_count", "tokenizer.ggml.tokens", "general.architecture"):
        assert f32.fields[name].contents() == stored.fields[name].contents()


@pytest.mark.parametrize("quantization", ["gguf", None])
def test_llama_cpp_decodes_the_same_gguf_as_ours_where_it_is_installed(quantization):
    """(Skipped where llama-cpp-python is not installed: it builds llama.cpp from source.)
    Its first greedy token is ours, on the GGUF as stored and on the F32 one; every row of a
    batch is decoded in full."""
    pytest.importorskip("llama_cpp")
    from offload.bench.llama_cpp import LlamaCpp

    workload = Workload(quantization=quantization, device="cpu", batch_sizes=(2,), output_len=4)
    prepared = prepare(workload)
    ids = prepared.prompt_ids(2)
    theirs, ours = LlamaCpp(prepared), Resident(prepared)
    for method in (theirs, ours):
        method.load()
    decoded, reference = theirs.run(ids), ours.run(ids)
    for method in (theirs, ours):
        method.close()
    assert decoded.tokens.shape == (2, 4) and len(decoded.step_s) == 3
    assert torch.equal(decoded.tokens[:, 0], reference.tokens[:, 0])
