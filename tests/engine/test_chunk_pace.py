"""The prompt tokens a turn carries beside the running rows' decode step when no
`max_num_batched_tokens` is set (`engine/chunk_pace.py`), from measured times."""

from __future__ import annotations

import time

import pytest

from offload.engine import chunk_pace, step_jobs
from offload.engine.chunk_pace import FLOOR, ChunkPace


def _measured(steps: list[float], prompts: list[tuple[int, float]]) -> ChunkPace:
    """A pace that measured decode steps of `steps` seconds, then forwards of (tokens,
    seconds) prompt tokens (their seconds as measured: a step's included)."""
    pace = ChunkPace()
    for seconds in steps:
        pace.decoded(time.perf_counter() - seconds)
    for tokens, seconds in prompts:
        pace.prefilled(tokens, time.perf_counter() - seconds)
    return pace


def test_nothing_measured_gives_the_least():
    assert ChunkPace().budget(1, 99) == FLOOR
    assert _measured([0.04], []).budget(3, 99) == FLOOR
    assert _measured([], [(100, 0.5)]).budget(3, 99) == FLOOR


def test_a_turn_s_prompt_tokens_take_about_a_decode_step_for_each_waiting_request():
    # Steps of 40 ms; forwards whose prompt tokens add 2 ms each (160 tokens: 0.32 s more).
    # (Budgets between two multiples of the floor: a measured time is a hair off its sleep.)
    pace = _measured([0.04] * 5, [(160, 0.04 + 0.32)] * 3)
    assert pace.budget(1, 99) == 16  # (40 ms of tokens: 20, in multiples of 8)
    assert pace.budget(3, 99) == 56  # (60)
    # A longer step takes more tokens (the disk tier: a step is a weight stream).
    slow = _measured([0.07] * 5, [(160, 0.07 + 0.32)] * 3)
    assert slow.budget(1, 99) == 32  # (35)
    # Never under the floor, always a multiple of it.
    costly = _measured([0.04] * 5, [(16, 0.04 + 0.4)] * 3)
    assert costly.budget(1, 99) == FLOOR
    assert all(pace.budget(n, 99) % FLOOR == 0 for n in range(1, 20))


def test_large_forwards_weigh_most_in_a_token_s_cost():
    """A small forward's time is mostly what any forward costs: measured together with a
    large one, the token's cost is near the large one's."""
    pace = _measured([0.04] * 5, [(10, 0.04 + 0.2), (400, 0.04 + 0.4)])
    # (0.6 s for 410 tokens: 1.46 ms a token; the small one's alone says 20 ms)
    assert pace.budget(1, 99) == FLOOR * int(0.04 / (0.6 / 410) // FLOOR)


def test_nothing_is_measured_while_a_step_compiles_in_the_background(monkeypatch):
    pace = _measured([0.04] * 5, [(160, 0.36)] * 3)
    monkeypatch.setattr(step_jobs, "busy", lambda: True)
    assert pace.start() is None
    pace.decoded(time.perf_counter() - 5.0)  # (a forward that began before the compile)
    pace.prefilled(16, time.perf_counter() - 5.0)
    monkeypatch.undo()
    assert pace.budget(1, 99) == 16  # (as before: the slow forwards were not counted)


@pytest.mark.parametrize("keep", [chunk_pace.KEEP])
def test_only_the_latest_measurements_count(keep):
    pace = _measured([1.0] * keep + [0.04] * keep, [(160, 10.0)] * keep + [(160, 0.36)] * keep)
    assert pace.budget(1, 99) == 16


def test_where_as_many_wait_as_rows_decode_prompts_go_whole():
    """A burst (15 chats arriving while one answer decodes) is admitted in one forward:
    its stall falls on fewer streams than it admits."""
    pace = _measured([0.04] * 5, [(160, 0.36)] * 3)
    assert pace.budget(15, 1) is None and pace.budget(8, 8) is None
    assert ChunkPace().budget(1, 1) is None
    assert pace.budget(1, 8) == 16 and pace.budget(7, 8) == 136
