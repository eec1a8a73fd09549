"""The bound of a step: max(compute, each link's bytes / its bandwidth)."""

import pytest

from offload.bench.bound import bound_step, step_over_bound

GB = 1e9
LINKS = {"memcpy": 10.0, "disk": 2.0, "page_cache": None, "h2d_pinned": 50.0}


@pytest.mark.parametrize(
    ("compute_s", "moved", "step_s", "limit"),
    [
        (0.010, {}, 0.010, "compute"),  # nothing moved: compute alone
        (0.010, {"memcpy": 0.05 * GB}, 0.010, "compute"),  # 5 ms of copies under 10 ms
        (0.010, {"memcpy": 0.2 * GB}, 0.020, "memcpy"),  # 20 ms of copies over 10 ms
        (0.010, {"disk": 0.1 * GB, "memcpy": 0.1 * GB}, 0.050, "disk"),  # the slowest link
        (0.010, {"disk": 0.0}, 0.010, "compute"),  # a link that moved nothing
        (0.010, {"page_cache": 1 * GB}, 0.010, "compute"),  # bandwidth not measured: left out
        (None, {"h2d_pinned": 1 * GB}, 0.020, "h2d_pinned"),  # compute unknown
        (None, {}, None, "compute"),  # nothing known at all
        (0.020, {"memcpy": 0.2 * GB}, 0.020, "compute"),  # a tie goes to compute
    ],
)
def test_bound_is_the_largest_of_compute_and_each_link(compute_s, moved, step_s, limit):
    bound = bound_step(compute_s, moved, LINKS)
    assert bound.step_s == (pytest.approx(step_s) if step_s is not None else None)
    assert bound.limit == limit


def test_each_link_time_is_reported():
    bound = bound_step(0.001, {"disk": 0.1 * GB, "memcpy": 0.1 * GB}, LINKS)
    assert bound.link_s == pytest.approx({"disk": 0.05, "memcpy": 0.01})


def test_an_unknown_link_is_refused_by_name():
    with pytest.raises(ValueError, match=r"names links \['nvlink'\]"):
        bound_step(0.01, {"nvlink": 1.0}, LINKS)


@pytest.mark.parametrize(
    ("step_s", "bound_s", "ratio"), [(0.02, 0.01, 2.0), (0.01, 0.01, 1.0), (0.01, None, None)]
)
def test_step_over_bound(step_s, bound_s, ratio):
    assert step_over_bound(step_s, bound_s) == ratio
