"""Which layers and parameters to offload: pure functions over indices, names and sizes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def matches_segments(name: str, segments: Iterable[str]) -> bool:
    """True if any of `segments` occurs in `name` as whole dot-separated segments.

    "experts" and "experts.w2_weight" match "mlp.experts.w2_weight"; "expert" and
    "w2" do not, and "w2_weight" does not match "w2_weight_scale".
    """
    dotted = f".{name}."
    return any(f".{segment}." in dotted for segment in segments)


def select_within_budget(
    named_sizes: Sequence[tuple[str, int]],
    max_bytes: int,
    used_bytes: int = 0,
    segments: Iterable[str] = (),
) -> list[str]:
    """Names to offload from one module, vLLM's UVA rule.

    Parameters are taken in order while the bytes already offloaded (`used_bytes`
    plus those taken here) are below `max_bytes`; the check runs before each
    parameter, so the last one taken may overshoot the budget. With `segments`,
    only matching names are candidates; others are skipped without stopping.
    """
    segments = tuple(segments)
    chosen: list[str] = []
    for name, num_bytes in named_sizes:
        if used_bytes >= max_bytes:
            break
        if segments and not matches_segments(name, segments):
            continue
        chosen.append(name)
        used_bytes += num_bytes
    return chosen


def unmatched_segments(names: Iterable[str], segments: Iterable[str]) -> set[str]:
    """The segments that match none of `names` (to warn about likely typos)."""
    names = tuple(names)
    return {seg for seg in segments if not any(matches_segments(n, (seg,)) for n in names)}


def offloaded_layer_indices(num_layers: int, group_size: int, num_in_group: int) -> list[int]:
    """vLLM's pattern: the last `num_in_group` layers of every `group_size` layers
    (8 and 2 give 6, 7, 14, 15, ...). A trailing partial group offloads only the
    indices that fall in its last `num_in_group` places."""
    return [i for i in range(num_layers) if i % group_size >= group_size - num_in_group]
