"""Pipeline stages: contiguous runs of the layers, one at least per rank, the largest
stage's time as small as any split makes it (checked against every split)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.errors import ConfigError
from offload.planner.stages import split_layers


def _largest(stages, layer_bytes, first, last, rates, rooms, disks=(None,) * 4):
    from offload.planner.stages import DISK_SLOWER

    size = len(stages)
    times = []
    for rank, stage in enumerate(stages):
        work = sum(layer_bytes[i] for i in stage)
        work += (first if rank == 0 else 0) + (last if rank == size - 1 else 0)
        room = rooms[rank]
        streamed = max(0, work - room) if room is not None else 0
        if disks[rank]:  # (its disk's rate measured)
            times.append((work - streamed) / rates[rank] + streamed / disks[rank])
        else:
            times.append((work - streamed + streamed * DISK_SLOWER) / rates[rank])
    return max(times)


@pytest.mark.parametrize(
    ("layer_bytes", "size", "first", "last", "expected"),
    [
        ([10] * 6, 2, 0, 0, [range(0, 3), range(3, 6)]),
        ([10] * 6, 3, 0, 0, [range(0, 2), range(2, 4), range(4, 6)]),
        ([10] * 6, 2, 0, 20, [range(0, 4), range(4, 6)]),  # (the head on the last rank)
        ([10] * 6, 6, 0, 0, [range(i, i + 1) for i in range(6)]),
        ([10] * 4, 1, 5, 5, [range(0, 4)]),
    ],
)
def test_a_split_balances_the_stages(layer_bytes, size, first, last, expected):
    assert split_layers(layer_bytes, size, first, last) == expected


def test_a_faster_rank_takes_more_layers():
    assert split_layers([10] * 6, 2, rates=[1.0, 2.0]) == [range(0, 2), range(2, 6)]


@settings(max_examples=150, deadline=None)
@given(
    layer_bytes=st.lists(st.integers(1, 100), min_size=1, max_size=8),
    size=st.integers(1, 4),
    first=st.integers(0, 200),
    last=st.integers(0, 200),
    rates=st.lists(st.sampled_from([0.5, 1.0, 3.0]), min_size=4, max_size=4),
    rooms=st.lists(st.one_of(st.none(), st.integers(0, 300)), min_size=4, max_size=4),
    disks=st.lists(st.sampled_from([None, 0.1, 0.4]), min_size=4, max_size=4),
)
def test_no_split_has_a_smaller_largest_stage(layer_bytes, size, first, last, rates, rooms, disks):  # fmt: skip
    if size > len(layer_bytes):
        with pytest.raises(ConfigError, match="pipeline_parallel_size must be between 1"):
            split_layers(layer_bytes, size, first, last, rates[:size], rooms[:size])
        return
    stages = split_layers(layer_bytes, size, first, last, rates[:size], rooms[:size], disks[:size])
    assert [i for stage in stages for i in stage] == list(range(len(layer_bytes)))
    assert all(len(stage) >= 1 for stage in stages)
    found = _largest(stages, layer_bytes, first, last, rates, rooms, disks)
    for cuts in itertools.combinations(range(1, len(layer_bytes)), size - 1):
        bounds = [0, *cuts, len(layer_bytes)]
        other = [range(bounds[i], bounds[i + 1]) for i in range(size)]
        assert found <= _largest(other, layer_bytes, first, last, rates, rooms, disks) + 1e-9


def test_a_stage_beyond_its_room_streams_the_rest():
    """Each rank keeps its room (its budget less its layers' KV cache) of its stage in RAM
    and streams the rest; a stage's step is the longer of its reads and its share of the
    compute, and a resident pipeline streams nothing."""
    from offload.planner.stages import estimate_stages

    layers = [100] * 4  # (2 GB/s RAM, 1 GB/s disk below: in bytes per ns)
    resident = estimate_stages(layers, 50, 2, None, 2e-9 * 1e9, 1.0, compute_s=0.0)
    assert [e.streamed_bytes for e in resident] == [0, 0]
    assert [e.weight_bytes for e in resident] == [200, 250]
    tight = estimate_stages(layers, 50, 2, 180, 2.0, 1.0, compute_s=0.0, kv_bytes=40)
    assert [e.streamed_bytes for e in tight] == [40, 90]  # (room 180 - 20 of KV each)
    assert tight[1].step_s == pytest.approx(160 / 2e9 + 90 / 1e9)
    busy = estimate_stages(layers, 50, 2, None, 2.0, 1.0, compute_s=1.0)
    assert [e.step_s for e in busy] == pytest.approx([200 / 450, 250 / 450])


def test_a_rank_with_less_room_takes_fewer_layers():
    """A rank whose budget holds 2 of the 6 layers streams what it holds beyond them from
    disk each step: it takes fewer layers than an unbounded one (bytes read from disk
    count `DISK_SLOWER` times)."""
    from offload.planner.stages import DISK_SLOWER

    assert split_layers([10] * 6, 2) == [range(0, 3), range(3, 6)]
    tight = split_layers([10] * 6, 2, rooms=[None, 20])
    assert tight == [range(0, 4), range(4, 6)]
    assert split_layers([10] * 6, 2, rooms=[20, 20]) == [range(0, 3), range(3, 6)]
    assert DISK_SLOWER > 1


def test_a_rank_with_a_slower_disk_streams_less():
    """Two ranks whose budgets each hold 2 of 6 layers: the one whose disk reads at a
    quarter of the other's takes fewer layers; with no disk rates known, an assumed
    ratio (`DISK_SLOWER`) for both, and an even split."""
    rooms, rates = [20, 20], [10.0, 10.0]
    assert split_layers([10] * 6, 2, rooms=rooms) == [range(0, 3), range(3, 6)]
    slow_second = split_layers([10] * 6, 2, rates=rates, rooms=rooms, disk_rates=[4.0, 1.0])
    assert slow_second == [range(0, 4), range(4, 6)]
    slow_first = split_layers([10] * 6, 2, rates=rates, rooms=rooms, disk_rates=[1.0, 4.0])
    assert slow_first == [range(0, 2), range(2, 6)]


def test_rates_measured_close_together_count_as_equal():
    from offload.planner.stages import steady

    assert steady([10.0, 11.5, 9.2]) == [10.0, 10.0, 10.0]
    assert steady([10.0, 30.0, 10.5]) == [10.5, 30.0, 10.5]
    assert steady([None, 2.0]) == [None, 2.0]
    assert steady([None, None]) == [None, None]


def test_ranks_on_one_host_take_its_median_rates():
    from offload.distributed.join import _per_host
    from offload.distributed.messages import Hello

    hellos = [Hello(r, "M", 4, None, place) for r, place in enumerate(["a cpu", "a cpu", "b cpu"])]
    assert _per_host(hellos, [10.0, 30.0, 5.0]) == [20.0, 20.0, 5.0]
    assert _per_host(hellos, [None, 30.0, 5.0]) == [None, 30.0, 5.0]
