import pytest
from hypothesis import given
from hypothesis import strategies as st

from offload.offloader.selection import (
    matches_segments,
    offloaded_layer_indices,
    select_within_budget,
    unmatched_segments,
)


@pytest.mark.parametrize(
    ("name", "segments", "expected"),
    [
        ("mlp.experts.w2_weight", {"experts"}, True),
        ("mlp.experts.w2_weight", {"experts.w2_weight"}, True),
        ("mlp.experts.w2_weight", {"mlp.experts.w2_weight"}, True),
        ("mlp.experts.w2_weight", {"expert"}, False),
        ("mlp.experts.w2_weight", {"w2"}, False),
        ("mlp.experts.w2_weight_scale", {"w2_weight"}, False),
        ("mlp.experts.w2_weight_scale", {"w2_weight_scale"}, True),
        ("mlp.experts.w2_weight", {"mlp.w2_weight"}, False),  # segments must be adjacent
        ("mlp.experts.w2_weight", {"xperts"}, False),
        ("self_attn.q_proj.weight", {"q_proj", "nothing"}, True),
        ("self_attn.q_proj.weight", set(), False),
        ("weight", {"weight"}, True),
        ("layers.10.mlp.weight", {"1"}, False),
        ("layers.10.mlp.weight", {"10"}, True),
    ],
)
def test_matches_whole_segments(name, segments, expected):
    assert matches_segments(name, segments) is expected


NAMES = [f"p{i}" for i in range(8)]
named_sizes = st.lists(st.integers(0, 1000), min_size=0, max_size=8).map(
    lambda sizes: list(zip(NAMES, sizes, strict=False))
)


@given(named_sizes, st.integers(0, 5000), st.integers(0, 3000), st.sets(st.sampled_from(NAMES)))
def test_budget_rule_is_vllms(named, max_bytes, used, segments):
    chosen = select_within_budget(named, max_bytes, used, segments)
    sizes = dict(named)
    candidates = [n for n, _ in named if not segments or n in segments]
    # Only candidates, in their order.
    assert chosen == [n for n in candidates if n in chosen]
    # Each chosen parameter was taken while the total was still under the budget...
    total = used
    for name in chosen:
        assert total < max_bytes
        total += sizes[name]
    # ...and a candidate is left out only once the budget is reached.
    left_out = [n for n in candidates if n not in chosen]
    if left_out:
        assert total >= max_bytes
    # The overshoot is at most the last parameter taken.
    if chosen:
        assert total - sizes[chosen[-1]] < max_bytes


def test_budget_overshoots_with_one_big_tensor():
    assert select_within_budget([("a", 10), ("b", 1000), ("c", 1)], 20) == ["a", "b"]


def test_budget_counts_bytes_already_used():
    assert select_within_budget([("a", 10), ("b", 10)], 20, used_bytes=15) == ["a"]
    assert select_within_budget([("a", 10)], 20, used_bytes=20) == []


def test_unmatched_segments():
    names = ["self_attn.q_proj.weight", "mlp.up_proj.weight"]
    assert unmatched_segments(names, {"mlp", "experts", "q_pro"}) == {"experts", "q_pro"}


@pytest.mark.parametrize(
    ("num_layers", "group", "num_in_group", "expected"),
    [
        (24, 8, 2, [6, 7, 14, 15, 22, 23]),  # vLLM's documented example
        (10, 8, 2, [6, 7]),
        (5, 1, 1, [0, 1, 2, 3, 4]),
        (5, 2, 1, [1, 3]),
        (7, 3, 3, [0, 1, 2, 3, 4, 5, 6]),
        (3, 8, 2, []),
    ],
)
def test_offloaded_layer_indices(num_layers, group, num_in_group, expected):
    assert offloaded_layer_indices(num_layers, group, num_in_group) == expected
