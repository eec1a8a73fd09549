"""Measurements: taken on a tiny model, cached per machine and workload, taken again on
request; their JSON and their compute between and beyond the measured batch sizes."""

import dataclasses
import json

import pytest
import torch
import zoo
from hypothesis import given
from hypothesis import strategies as st

from offload.model.build import build_empty
from offload.planner.measurements import Measurements
from offload.planner.shape import shape_of
from offload.probes.measure import MeasureSettings, cache_key_of, measure


@pytest.fixture(autouse=True)
def _a_quiet_machine(monkeypatch):
    """The other test worker keeps this machine busy, as the measurements would rightly
    say: each test here sees a quiet one unless it says otherwise."""
    from offload.probes import measure as measuring

    monkeypatch.setattr(measuring.OthersLoad, "fraction", lambda self: 0.0)


TINY = MeasureSettings(
    copy_bytes=2**20, disk_bytes=2**20, probe_file_bytes=2**20, disk_passes=1, warmup=1, repeats=3
)
CPU = torch.device("cpu")


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A tiny Llama checkpoint, its shape, and an empty cache folder."""
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    path = zoo.save_with_tokenizer(zoo.build("llama"), tmp_path / "model")
    return path, shape_of(build_empty(path, "auto"), 16)


def test_a_miss_measures_and_caches_a_hit_reads(tiny, tmp_path):
    path, shape = tiny
    first = measure(path, shape, CPU, [1, 2], 16, settings=TINY)
    assert not first.from_cache and first.path.parent == tmp_path / "cache" / "plans"
    m = first.measurements
    assert m.batch_sizes == [1, 2] and len(m.layer_s) == len(m.head_s) == 2
    assert all(s > 0 for s in m.layer_s) and all(s >= 0 for s in m.head_s)
    assert m.link_gb_per_s > 0 and m.disk_gb_per_s > 0
    assert m.disk_source == "the checkpoint's files, its layers in the order they run"
    assert m.disk_busy_gb_per_s > 0 and m.notes == []  # on a CPU: read beside compute too
    second = measure(path, shape, CPU, [1, 2], 16, settings=TINY)
    assert second.from_cache and second.path == first.path and second.measurements == m


def test_remeasure_replaces_and_another_workload_misses(tiny):
    path, shape = tiny
    first = measure(path, shape, CPU, [1, 2], 16, settings=TINY)
    again = measure(path, shape, CPU, [1, 2], 16, settings=TINY, remeasure=True)
    assert not again.from_cache and again.path == first.path
    assert Measurements.from_json(again.path.read_text()) == again.measurements
    other = measure(path, shape, CPU, [1, 4], 16, settings=TINY)
    assert not other.from_cache and other.path != first.path


def test_a_damaged_cache_file_is_measured_again(tiny):
    path, shape = tiny
    first = measure(path, shape, CPU, [1], 16, settings=TINY)
    first.path.write_text('{"machine": "half a fi')
    with pytest.warns(UserWarning, match="cached measurements .* are not valid"):
        assert not measure(path, shape, CPU, [1], 16, settings=TINY).from_cache
    first.path.write_text(json.dumps({"unknown": 1}))
    with pytest.warns(UserWarning, match="not valid"):
        assert not measure(path, shape, CPU, [1], 16, settings=TINY).from_cache


BAD_VALUES = [
    ("layer_s", [1e-12]),  # would predict 10**11 tokens/s
    ("layer_s", [-1.0]),
    ("layer_s", [float("nan")]),
    ("head_s", [float("inf")]),
    ("layer_s", ["fast"]),
    ("layer_s", 3),
    ("link_gb_per_s", -2.0),
    ("disk_gb_per_s", 1e300),
    ("batch_sizes", [0]),
    ("context_len", True),
    ("notes", "none"),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_a_value_no_measurement_can_have_is_refused(field, value):
    data = json.loads(_figures(batch_sizes=[1], layer_s=[1.0], head_s=[2.0]).to_json())
    data[field] = value
    with pytest.raises(ValueError):
        Measurements.from_json(json.dumps(data))


def test_a_cached_value_no_measurement_can_have_is_thrown_away(tiny):
    """Edited or damaged by hand: one warning, measured again, and the entry replaced."""
    path, shape = tiny
    first = measure(path, shape, CPU, [1], 16, settings=TINY)
    data = json.loads(first.path.read_text())
    data["layer_s"] = [1e-12]
    first.path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match=f"{first.path}.* are not valid .*; measuring again"):
        again = measure(path, shape, CPU, [1], 16, settings=TINY)
    assert not again.from_cache and again.measurements.layer_s[0] >= 1e-7
    assert Measurements.from_json(first.path.read_text()) == again.measurements  # healed
    assert measure(path, shape, CPU, [1], 16, settings=TINY).from_cache


def test_without_checkpoint_files_the_disk_is_measured_on_a_file_of_its_own(tiny, tmp_path):
    path, shape = tiny
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((path / "config.json").read_text())
    m = measure(bare, shape, CPU, [1], 16, settings=TINY).measurements
    assert m.disk_gb_per_s > 0 and m.disk_source.startswith("a 1 MiB file in ")
    names = sorted(p.name for p in (tmp_path / "cache" / "plans").iterdir())
    assert names == [f"{cache_key_of(m)}.json", f"{cache_key_of(m)}.json.digest"]  # (its signature)


def _figures(**changes) -> Measurements:
    figures = dict(
        machine="m",
        software="s",
        device_type="cpu",
        model_digest="d",
        dtype="float32",
        context_len=8,
        batch_sizes=[1, 4],
        layer_s=[1.0, 4.0],
        head_s=[2.0, 5.0],
        link_gb_per_s=1.0,
        disk_gb_per_s=1.0,
    )
    return Measurements(**{**figures, **changes})


@pytest.mark.parametrize(
    ("batch", "expected"),
    [(1, (1.0, 2.0)), (4, (4.0, 5.0)), (2, (2.0, 3.0)), (8, (8.0, 10.0))],
)
def test_compute_between_and_beyond_the_measured_batches(batch, expected):
    assert _figures().compute_at(batch) == pytest.approx(expected)


def test_json_round_trip_and_refusals():
    figures = _figures(notes=["a note"])
    assert Measurements.from_json(figures.to_json()) == figures
    with pytest.raises(ValueError, match="one entry per batch size"):
        Measurements.from_json(_figures(layer_s=[1.0]).to_json())
    with pytest.raises(ValueError, match="measurements must be an object with keys"):
        Measurements.from_json("[1, 2]")
    assert Measurements.from_json(_figures(layer_s=[0.0, 0.0]).to_json())  # not measured
    with pytest.raises(ValueError, match="cannot take less than"):
        Measurements.from_json(_figures(layer_s=[1e-9, 1.0]).to_json())


@pytest.mark.parametrize("arch", ["gpt2", "gemma2", "deepseek_v3", "mamba"])
def test_compute_is_measured_for_each_architecture(arch, tmp_path, monkeypatch):
    # Learned positions (gpt2), per-layer kinds (gemma2), a dense first layer before the
    # experts (deepseek_v3), no KV cache at all (mamba).
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / arch
    zoo.build(arch).save_pretrained(path)
    shape = shape_of(build_empty(path, "auto"), 16)
    # More timed pairs than TINY's: a zoo layer takes microseconds, and beside the other
    # worker's tests three pairs (and their retries) once all read as noise.
    settings = dataclasses.replace(TINY, repeats=9)
    m = measure(path, shape, CPU, [1, 2], 16, settings=settings).measurements
    assert m.notes == [] and all(s > 0 for s in m.layer_s)
    if arch == "deepseek_v3":  # the layer timed is one of the experts' layers
        assert shape.timed_layer == 1


def test_the_cut_models_stay_within_the_bytes_they_may_take(tmp_path):
    from offload.errors import ModelError
    from offload.probes.compute import _extra_layers

    path = zoo.save_with_tokenizer(zoo.build("llama", num_layers=12), tmp_path / "model")
    shape = shape_of(build_empty(path, "auto"), 16)
    size, outside = shape.layer_bytes[shape.timed_layer], shape.outside_bytes
    assert _extra_layers(shape, 2, None) == 6  # 2 layers timed against 8
    # Room for the longer model (the shorter shares its weights): the 2 layers of the
    # shorter and two and a half more: 2 against 4.
    assert _extra_layers(shape, 2, outside + 4 * size + size // 2) == 2
    # And for both models' KV caches, `cache` a layer: the shorter's layers in both.
    cache = size // 4
    room = outside + 2 * (size + 2 * cache) + 5 * (size + cache) // 2
    assert _extra_layers(shape, 2, room, cache) == 2
    with pytest.raises(ModelError, match="more than the"):
        _extra_layers(shape, 2, outside + 3 * size - 1)


def test_on_a_gpu_the_probes_copy_within_the_device_budget():
    settings = MeasureSettings(max_device_bytes=100 * 2**20)
    assert settings.on(torch.device("cuda")).copy_bytes == 25 * 2**20
    assert settings.on(CPU) == settings  # a CPU's budget is host memory: no change
    assert MeasureSettings().on(torch.device("cuda")) == MeasureSettings()


def test_the_compute_probe_times_more_steps_than_the_context_has(tiny):
    # Each step writes the last of 4 positions again: 3 timings of 1 + 3 pairs of steps each
    # are 24 steps of each cut model (transformers 5's static cache counts positions itself).
    from offload.probes.compute import CutFrom, DecodeTimer

    path, shape = tiny
    timer = DecodeTimer(CutFrom(path, shape, CPU, 4))
    for _ in range(3):
        layer_s, head_s = timer.time([1, 2], warmup=1, repeats=3)
        assert len(layer_s) == len(head_s) == 2 and all(s >= 0 for s in layer_s)


def test_forward_copies_time_the_copies_a_streamed_forward_makes(tiny):
    # Every layer of the cut model is copied in at each step (asked for 3 layers, it has 4:
    # with 2 slots a third layer would sit alone in its slot, never copied again): the
    # bytes copied per step are its layers' bytes.
    from offload.probes.compute import CutFrom, ForwardCopies

    path, shape = tiny
    copies = ForwardCopies(CutFrom(path, shape, CPU, 4), count=3)
    try:
        stats = copies.offloader.stats
        assert stats().num_offloaded_layers == 4
        copies.gb_per_s(2)
        before = stats().bytes_copied
        assert copies.gb_per_s(2) > 0
        assert stats().bytes_copied - before == 4 * shape.layer_bytes[0]  # layers alike
    finally:
        copies.close()


def test_a_cpus_link_is_the_rate_of_copies_in_a_forward(tiny, monkeypatch):
    from offload.probes import compute

    path, shape = tiny
    monkeypatch.setattr(compute.ForwardCopies, "gb_per_s", lambda self, batch: 123.0)
    # More timed pairs than TINY's: a zoo layer takes microseconds, and beside the other
    # worker's tests three pairs (and their retries) once all read as noise.
    settings = dataclasses.replace(TINY, repeats=9)
    m = measure(path, shape, CPU, [1, 2], 16, settings=settings).measurements
    assert m.link_gb_per_s == 123.0 and m.notes == []


def test_a_layer_timed_as_no_time_is_timed_again(tiny):
    """Noise can make the longer cut model's step no slower than the shorter's: a layer
    takes time, so more pairs are timed rather than a layer of 0 s reported."""
    from offload.probes.compute import CutFrom, DecodeTimer

    path, shape = tiny
    timer = DecodeTimer(CutFrom(path, shape, CPU, 16))
    calls = {0: 0, 1: 0}

    def step(which, batch):
        def timed():
            calls[which] += 1
            return 1.0 + (0.5 if which == 1 and calls[1] > 3 else 0.0)  # equal at first

        return timed

    timer._step = step
    [layer], _ = timer.time([1], warmup=0, repeats=3)
    assert calls == {0: 6, 1: 6} and layer == pytest.approx(0.25 / timer.extra)


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        ([1.0, 0.8, 5.0], [1.0, 1.0, 2.0]),  # batch 2 faster a step, batch 4 slower a sequence
        ([1.0, 1.5, 2.5], [1.0, 1.5, 2.5]),  # physical: kept
    ],
)
def test_compute_times_are_made_physical(seconds, expected):
    from offload.probes.measure import consistent_times

    assert consistent_times([1, 2, 4], seconds) == expected


@given(st.lists(st.floats(1e-4, 1.0), min_size=1, max_size=7))
def test_larger_batches_are_never_slower_a_sequence_nor_faster_a_step(seconds):
    from offload.probes.measure import consistent_times

    batches = [2**k for k in range(len(seconds))]
    times = consistent_times(batches, seconds)
    for i in range(1, len(times)):
        assert times[i] >= times[i - 1] * (1 - 1e-12)
        assert times[i] / batches[i] <= times[i - 1] / batches[i - 1] * (1 + 1e-12)


def test_a_busy_machine_is_said_so_in_the_notes(tiny, monkeypatch):
    from offload.probes import measure as measuring

    path, shape = tiny
    monkeypatch.setattr(measuring.OthersLoad, "fraction", lambda self: 0.6)
    notes = measure(path, shape, CPU, [1, 2], 16, settings=TINY).measurements.notes
    assert any("busy while measuring: other processes used 60% of its CPUs" in n for n in notes)
    monkeypatch.setattr(measuring.OthersLoad, "fraction", lambda self: 0.1)
    quiet = measure(path, shape, CPU, [1, 2], 16, settings=TINY, remeasure=True)
    assert not any("busy" in n for n in quiet.measurements.notes)


def test_a_process_that_ends_takes_nothing_from_the_others_load():
    """The load is each process's own growth: one gone since the start (its CPU time no
    longer in /proc) neither lowers it nor makes it negative."""
    from offload.probes.host import others_used_s

    before = {10: 50.0, 11: 2.0, 12: 7.0}
    assert others_used_s(before, {11: 2.5, 13: 0.25}) == 0.75  # 10 ended, 13 is new
    assert others_used_s(before, {12: 1.0}) == 0.0  # (12 is another process now)


def test_another_process_spinning_reads_as_others_load():
    """One other process spinning for the whole window uses one CPU of the machine's."""
    import os
    import subprocess
    import sys
    import time

    from offload.probes.host import _others_s, others_used_s

    spin = "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"
    # Started through a shell that exits at once: not this process's descendant (whose
    # time is its own), as another program's would be.
    subprocess.run(["sh", "-c", f'"{sys.executable}" -c "{spin}" &'], check=True)
    time.sleep(0.3)  # (its start-up)
    before, started = _others_s(), time.perf_counter()
    time.sleep(0.8)
    used = others_used_s(before, _others_s())
    busy = used / ((time.perf_counter() - started) * os.cpu_count())
    assert busy >= 0.6 / os.cpu_count(), busy
