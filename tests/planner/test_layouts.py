"""The placements the planner weighs, from a model's sizes alone."""

import math

import pytest

from offload.offloader.selection import offloaded_layer_indices
from offload.planner import layouts
from offload.sizes import GIB, MIB


@pytest.mark.parametrize("num_layers", [1, 2, 7, 30, 80])
def test_one_pattern_for_each_count_of_offloaded_layers(num_layers):
    patterns = layouts.spread_patterns(num_layers)
    counts = [len(offloaded_layer_indices(num_layers, g, n)) for g, n in patterns]
    assert sorted(counts) == list(range(1, num_layers + 1))
    for (group, num), count in zip(patterns, counts, strict=True):
        # No smaller group gives as many: the layers are spread as far as the pattern can.
        smaller = [
            (g, n)
            for g in range(1, group)
            for n in range(1, g + 1)
            if len(offloaded_layer_indices(num_layers, g, n)) == count
        ]
        assert smaller == [], (group, num)


def test_prefetch_within_the_host_budget(smollm2_shape):
    layout = layouts.prefetch(smollm2_shape, 2, 1, 2, 10 * GIB, "direct")
    assert layout.places[:4] == ("resident", "host", "resident", "host")
    assert layout.offloaded_bytes == 15 * smollm2_shape.layer_bytes[1]
    assert layout.host_bytes == layout.offloaded_bytes and layout.disk_bytes == 0
    assert layout.staging_bytes == 2 * smollm2_shape.layer_bytes[1]
    assert not layout.config.disk.is_active and layout.prefetch_step == 2


def test_the_disk_tier_beyond_the_host_budget(smollm2_shape):
    layer = smollm2_shape.layer_bytes[0]
    layout = layouts.prefetch(smollm2_shape, 1, 1, 1, 100 * MIB, "direct")
    assert layout.config.disk.cpu_memory_gb == 0.09  # 100 MiB, down to a hundredth of a GiB
    assert layout.host_bytes == (int(0.09 * GIB) // layer) * layer
    assert layout.places.count("disk") == 30 - layout.host_bytes // layer
    # Reads from disk need read_ahead + 1 slots: the offloader raises the step to 3.
    assert layout.prefetch_step == 3 and layout.staging_bytes == 3 * layer
    assert "read from disk" in layout.label


def test_uva_of_the_least_that_is_needed(smollm2_shape):
    layer = smollm2_shape.layer_bytes[0]
    layout = layouts.uva(smollm2_shape, int(2.5 * layer))
    gib = math.ceil(2.5 * layer / GIB * 100) / 100
    assert layout.config.uva.cpu_offload_gb == gib
    assert layout.places[:4] == ("uva", "uva", "uva", "uva") and layout.places[4] == "resident"
    assert layout.offloaded_bytes == int(gib * GIB) and layout.staging_bytes == 0
    assert layouts.uva(smollm2_shape, 0) is None
    assert layouts.uva(smollm2_shape, sum(smollm2_shape.layer_bytes) + 1) is None
    assert layouts.uva(smollm2_shape, layer, experts_only=True) is None  # a dense model


@pytest.mark.parametrize(
    ("gib", "rounding", "expected"),
    [(0.1, math.floor, 0.1), (0.0999999, math.floor, 0.09), (0.101, math.ceil, 0.11)],
)
def test_hundredths(gib, rounding, expected):
    assert layouts.hundredths(int(gib * GIB) / GIB, rounding) == expected
