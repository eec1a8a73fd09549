"""Disk placement: the budget holds, and the bytes left on disk are the fewest."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.memory.placement import DiskIO
from offload.offloader.disk_placement import (
    StackRoomError,
    fit_stack,
    grain_for,
    place_on_disk,
)

GRAIN = 2**20

sizes_st = st.lists(st.integers(1, 9 * GRAIN), min_size=1, max_size=9)


def test_small_units_get_a_fine_grain():
    """Units far below a MiB are placed by their own sizes (a page grain)."""
    layer = 100_000
    assert place_on_disk([layer] * 6, 3 * layer).count(False) == 3


@settings(max_examples=200, deadline=None)
@given(sizes=sizes_st, budget=st.integers(0, 40 * GRAIN))
def test_the_budget_holds_and_the_streamed_bytes_are_the_fewest(sizes, budget):
    on_disk = place_on_disk(sizes, budget)
    kept = [s for s, disk in zip(sizes, on_disk, strict=True) if not disk]
    assert sum(kept) <= budget
    grain = grain_for(budget, sizes)
    grains = [-(-s // grain) for s in sizes]
    if sum(sizes) > budget:  # else everything is kept
        best = max(
            sum(c)
            for r in range(len(grains) + 1)
            for c in itertools.combinations(grains, r)
            if sum(c) <= budget // grain
        )
        assert sum(-(-s // grain) for s in kept) == best
    else:
        assert not any(on_disk)


def test_a_better_fill_beats_taking_the_largest_first():
    assert place_on_disk([6 * GRAIN, 5 * GRAIN, 5 * GRAIN], 10 * GRAIN) == [True, False, False]


def test_edges_and_even_spreading():
    layer = 13 * GRAIN
    assert place_on_disk([layer] * 4, 0) == [True] * 4
    assert place_on_disk([layer] * 4, 4 * layer) == [False] * 4
    assert place_on_disk([layer] * 4, 4 * layer - 1) == [True, False, False, False]
    half = place_on_disk([layer] * 30, 15 * layer)
    assert half.count(False) == 15
    assert all(a != b for a, b in itertools.pairwise(half))  # alternating
    assert place_on_disk([layer] * 30, layer) == [True] * 29 + [False]


# -- a whole stack in a process budget (fit_stack) ---------------------------------

LAYER = 10 * GRAIN


@settings(max_examples=200, deadline=None)
@given(
    num_units=st.integers(1, 8),
    room=st.integers(0, 100 * GRAIN),
    num_slots=st.integers(2, 4),
    io=st.sampled_from([DiskIO.MMAP, DiskIO.DIRECT]),
)
def test_kept_units_slots_and_the_mapped_window_fit_the_room(num_units, room, num_slots, io):
    sizes = [LAYER] * num_units
    try:
        fit = fit_stack(sizes, sizes, range(num_units), room, num_slots, io, asked=True)
    except StackRoomError as error:
        assert error.need_bytes > room  # refused only where streaming needs more
        assert f"{room / 2**20:.0f} MiB" in str(error)
        return
    kept = sum(size for size, in_ram in zip(sizes, fit.in_ram, strict=True) if in_ram)
    streaming = 0
    if not all(fit.in_ram):  # a mapped window of one unit, or a slot per unit in flight
        streaming = LAYER if io == DiskIO.MMAP else min(num_slots, num_units) * LAYER
    if io == DiskIO.DIRECT and all(fit.in_ram):  # kept units are copied into slots too
        streaming = min(num_slots, num_units) * LAYER
    assert fit.ram_bytes == kept + streaming <= room
    assert all(fit.in_ram) or kept > room - streaming - LAYER  # no unit more would fit


def test_mapped_units_take_a_window_where_reads_take_a_slot_ring():
    """Four layers, room for two: mapped, one layer's pages at a time leaves room to keep
    one layer (its pages held); read into three slots, none fits at all."""
    sizes = [LAYER] * 4
    mapped = fit_stack(sizes, sizes, range(4), 2 * LAYER, 3, DiskIO.MMAP, asked=False)
    assert (mapped.io, mapped.in_ram.count(True), mapped.ram_bytes) == (DiskIO.MMAP, 1, 2 * LAYER)
    with pytest.raises(StackRoomError, match=r"needs at least 30 MiB .*3 slots.* 20 MiB"):
        fit_stack(sizes, sizes, range(4), 2 * LAYER, 3, DiskIO.DIRECT, asked=False)
    everything = fit_stack(sizes, sizes, range(4), 4 * LAYER, 3, DiskIO.MMAP, asked=False)
    assert all(everything.in_ram) and everything.ram_bytes == 4 * LAYER  # no window needed


def test_auto_reads_where_the_mapped_window_does_not_fit_and_mmap_asked_is_refused():
    """A unit that cannot stream (another dtype) stays in RAM and in a slot: with little
    room left, "auto" gives up the mapping (and then cannot fit the slots either); an
    explicit mmap is refused, naming the numbers."""
    sizes = [LAYER, LAYER, LAYER]
    room = 2 * LAYER + LAYER // 2  # the fixed unit and its slot: 20 MiB; a window: 10 more
    with pytest.raises(StackRoomError, match=r"largest layer's mapped pages, 10 MiB"):
        fit_stack(sizes, sizes, [1, 2], room, 2, DiskIO.MMAP, asked=True)
    with pytest.raises(StackRoomError, match=r"2 slots"):  # auto: read, which needs more
        fit_stack(sizes, sizes, [1, 2], room, 2, DiskIO.MMAP, asked=False)
    fit = fit_stack(sizes, sizes, [1, 2], 3 * LAYER, 2, DiskIO.MMAP, asked=False)
    assert fit.io == DiskIO.MMAP and fit.in_ram == [True, False, False]
