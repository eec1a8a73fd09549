"""The disk probe reads a checkpoint as the disk tier does: layer by layer in the order they
run (not the order of the file, where layer 10 comes before layer 2), and leaves a warm
checkpoint warm."""

import pytest
import zoo

from offload.memory.page_cache import cached_bytes
from offload.memory.safetensors import checkpoint_tensors
from offload.probes import disk as probes


@pytest.fixture
def twelve_layers(tmp_path):
    return zoo.save_with_tokenizer(zoo.build("llama", num_layers=12), tmp_path / "model")


def test_layer_reads_follow_the_layers_not_the_file(twelve_layers):
    reads = probes.layer_reads(twelve_layers, "model.layers")
    assert len(reads) == 12
    stored = checkpoint_tensors(twelve_layers)
    for index, extents in enumerate(reads):
        ranges = [
            (t.offset, t.offset + t.num_bytes)
            for name, t in stored.items()
            if name.startswith(f"model.layers.{index}.")
        ]
        # The layer's reads cover its tensors and nothing of another layer's.
        for start, end in ranges:
            assert any(
                e.file_offset <= start and end <= e.file_offset + e.num_bytes for e in extents
            )
        lowest, highest = min(s for s, _ in ranges), max(e for _, e in ranges)
        for extent in extents:
            assert extent.file_offset > lowest - probes.ALIGN
            assert extent.file_offset + extent.num_bytes < highest + probes.ALIGN
    starts = [min(e.file_offset for e in extents) for extents in reads]
    assert starts != sorted(starts)  # stored in name order: 10 and 11 come before 2


def test_no_layer_of_that_name_gives_no_reads(twelve_layers):
    assert probes.layer_reads(twelve_layers, "transformer.h") == []


def test_the_probe_reads_the_layers_and_leaves_a_warm_file_warm(twelve_layers):
    files = sorted(twelve_layers.glob("*.safetensors"))
    reads = probes.layer_reads(twelve_layers, "model.layers")
    for path in files:
        path.read_bytes()  # warm
    assert all(cached_bytes(path) >= path.stat().st_size for path in files)
    with probes.kept_warm(files):
        rate = probes.disk_gb_per_s(files, 2**30, 2, computing=True, reads=reads)
        assert cached_bytes(files[0]) < files[0].stat().st_size  # O_DIRECT dropped it
    assert rate > 0
    assert all(cached_bytes(path) >= path.stat().st_size for path in files)
