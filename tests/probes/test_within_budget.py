"""The probes within a CPU's budget (`MeasureSettings.max_host_bytes`, from `cpu_memory_gb`):
a link copy and the disk probe's reads sized to it, the compute probe's two cut models
taking the memory of one, and a streamed model that does not fit left unmeasured."""

import dataclasses

import pytest
import torch
import zoo

from offload.memory.disk_layout import ALIGN
from offload.model.build import build_empty
from offload.planner.shape import shape_of
from offload.probes import disk as probes
from offload.probes.measure import MeasureSettings, measure
from offload.sizes import MIB

CPU = torch.device("cpu")
TINY = MeasureSettings(
    copy_bytes=2**20, disk_bytes=2**20, probe_file_bytes=2**20, disk_passes=1, warmup=1, repeats=3
)


@pytest.fixture
def twelve_layers(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    path = zoo.save_with_tokenizer(zoo.build("llama", num_layers=12), tmp_path / "model")
    return path, shape_of(build_empty(path, "auto"), 16)


def test_on_a_cpu_the_copies_fit_the_budget():
    settings = MeasureSettings(max_host_bytes=100 * MIB)
    assert settings.on(CPU).copy_bytes == 25 * MIB  # two buffers: half the budget
    assert settings.max_read_bytes == 25 * MIB  # two reads in flight: half again
    assert MeasureSettings().on(CPU) == MeasureSettings()  # no budget: no change
    assert MeasureSettings().max_read_bytes is None


@pytest.mark.parametrize("max_read_bytes", [ALIGN, 3 * ALIGN, 10 * ALIGN + 1, 2**30])
def test_reads_cut_to_the_budget_cover_the_same_bytes_in_order(twelve_layers, max_read_bytes):
    path, _ = twelve_layers
    reads = probes.layer_reads(path, "model.layers")
    cut = probes._split(reads, max_read_bytes)
    limit = max(ALIGN, max_read_bytes // ALIGN * ALIGN)
    assert all(sum(e.num_bytes for e in extents) <= limit for extents in cut)
    assert all(e.file_offset % ALIGN == 0 and e.num_bytes % ALIGN == 0 for r in cut for e in r)

    def covered(some):
        return [(e.path, b) for r in some for e in r for b in range(e.file_offset, e.file_offset + e.num_bytes, ALIGN)]  # fmt: skip

    assert covered(cut) == covered(reads)  # every block, in the order the layers run


def test_the_shorter_cut_model_shares_the_longers_weights(twelve_layers):
    from offload.probes.compute import CutFrom, DecodeTimer

    path, shape = twelve_layers
    timer = DecodeTimer(CutFrom(path, shape, CPU, 8))
    shorter, longer = timer.models
    own = dict(longer.named_parameters(remove_duplicate=False))
    names = dict(shorter.named_parameters(remove_duplicate=False))
    assert len(names) < len(own)
    assert all(tensor is own[name] for name, tensor in names.items())
    layers, _ = timer.time([1, 2], warmup=1, repeats=3)  # and both still decode
    assert len(layers) == 2


def test_a_streamed_model_beyond_the_budget_is_not_measured(twelve_layers, monkeypatch):
    from offload.probes import measure as measuring

    monkeypatch.setattr(measuring, "MARGIN_BYTES", 0)  # (64 MiB: larger than this model)
    path, shape = twelve_layers
    # Room for the cut models that time compute (the weights outside the layers are the
    # fixed overhead's), not for 4 streamed layers and 2 slots beside them.
    room = 5 * shape.layer_bytes[0] + shape.activation_bytes
    settings = dataclasses.replace(TINY, repeats=9, max_host_bytes=room)
    m = measure(path, shape, CPU, [1], 16, settings=settings).measurements
    assert any(
        n.startswith("copies in a forward not measured (a model of 4 streamed") for n in m.notes
    )
    assert all(s > 0 for s in m.layer_s) and m.link_gb_per_s > 0
