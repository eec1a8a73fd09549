"""What speculative decoding is predicted to give on a plan, and the k chosen: many guesses
where bytes set the step (weights streamed over PCIe), none where compute does."""

import pytest

from offload.planner.choose import Budgets
from offload.planner.speculation import MARGIN, for_plan, pick, tokens_per_forward
from offload.sizes import GIB

HOST = 200 * GIB


def test_tokens_per_forward_is_the_kept_run_plus_the_model_s_own():
    assert tokens_per_forward(0.0, 5) == 1.0
    assert tokens_per_forward(1.0, 5) == 6.0
    assert tokens_per_forward(0.5, 2) == pytest.approx(1.75)
    with pytest.raises(ValueError, match="acceptance must be in"):
        tokens_per_forward(1.5, 2)


def test_pick_weighs_the_tokens_kept_against_the_turn_s_cost():
    # bytes-bound: a turn costs the same at any k: the deepest pays most
    best, weighed = pick(1.0, lambda k: 1.0, 0.9, most=16)
    assert best.k == 16 and len(weighed) == 16
    assert best.speedup == pytest.approx(tokens_per_forward(0.9, 16))
    # compute-bound: each guess costs a position's compute; half kept never pays
    off, _ = pick(1.0, lambda k: 1.0 + k, 0.5)
    assert off.k == 0 and off.speedup == 1.0
    # between: a cost that grows slowly has a best k inside the range
    middle, weighed = pick(1.0, lambda k: 1.0 + 0.15 * k, 0.8)
    assert 1 < middle.k < 16
    assert middle.speedup == max(s.speedup for s in weighed) >= MARGIN


def test_a_plan_streaming_llama_8b_over_pcie_guesses_deep(planned, recorded, llama8b_shape):
    """The issue's GPU case on the recorded H100: most layers prefetched at batch 1, a
    1B-shape draft resident: the verify forward moves the same bytes, and k is large."""
    figures = recorded["h100-llama-3-8b"]
    plan = planned(llama8b_shape, figures, Budgets(6 * GIB, HOST), [1])
    assert plan.chosen.time.limit == "link"
    best, weighed = for_plan(plan, "draft_model", draft_bytes=2 * GIB)
    assert best.k >= 8 and best.speedup > 2.5
    turns = [s.turn_s for s in weighed]
    assert turns == sorted(turns)  # (each guess costs something: compute and the draft's step)
    assert turns[-1] < 1.5 * plan.chosen.time.step_s  # (but the bytes set the turn)


def test_a_resident_cpu_plan_leaves_speculation_off(planned, recorded, smollm2_shape):
    plan = planned(smollm2_shape, recorded["cpu-smollm2"], Budgets(20 * GIB, HOST), [64])
    assert plan.chosen.layout.label == "resident"
    best, _ = for_plan(plan, "ngram")
    assert best.k == 0
    best, _ = for_plan(plan, "ngram", acceptance=1.0)  # (even all kept: compute grows k-fold)
    assert best.speedup < 2.0
