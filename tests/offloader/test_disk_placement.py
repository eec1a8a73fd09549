"""Disk placement: the budget holds, and the bytes left on disk are the fewest."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from offload.offloader.disk_placement import grain_for, place_on_disk

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
