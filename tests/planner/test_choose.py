"""The chooser on the recorded measurement sets (an H100 with the Llama-3-8B shape, this
CPU with SmolLM2's): what it picks as the budgets change, and that no hand setting is
faster by the cost model than the plan."""

import itertools

import pytest

from offload.errors import ModelError
from offload.planner import layouts
from offload.planner.choose import Budgets, candidates, evaluate
from offload.planner.flags import warnings_for
from offload.sizes import GIB, MIB

HOST = 128 * GIB


def test_resident_when_it_fits_and_says_so(recorded, llama8b_shape, planned):
    plan = planned(llama8b_shape, recorded["h100-llama-3-8b"], Budgets(70 * GIB, HOST))
    assert plan.config.selected_backend == "none" and not plan.kv_offload
    assert plan.batch_size == 64  # the largest batch: resident decode is compute-bound
    assert warnings_for(plan) == ["the model fits: no offloading needed"]


@pytest.mark.parametrize("batch", [1, 16])
def test_a_smaller_device_budget_offloads_more(recorded, llama8b_shape, batch):
    offloaded = []
    for budget_gib in (20, 14, 12, 10, 8, 6):
        found = candidates(
            llama8b_shape, recorded["h100-llama-3-8b"], Budgets(budget_gib * GIB, HOST), [batch]
        )
        offloaded.append(found[0].layout.offloaded_bytes)
    assert offloaded[0] == 0
    assert offloaded == sorted(offloaded) and offloaded[-1] > offloaded[1] > 0


def test_prefetch_overlaps_on_the_gpu(recorded, llama8b_shape, planned):
    plan = planned(llama8b_shape, recorded["h100-llama-3-8b"], Budgets(10 * GIB, HOST), [1])
    assert plan.config.selected_backend == "prefetch"
    # The copies run back to back beside compute: the step is at its bound, the link.
    # (One slot here: a second would cost a layer's device memory, so one more layer
    # offloaded, 8 ms more on the link, for the 0.2 ms a layer the link idles without it.)
    time = plan.chosen.time
    assert time.limit == "link" and time.step_s <= 1.05 * time.link_s
    (warning,) = warnings_for(plan)
    assert warning.startswith("transfer-bound: step is ")
    assert "would cost almost nothing more" in warning


def test_the_disk_tier_takes_what_the_host_budget_cannot(recorded, smollm2_shape, planned):
    budgets = Budgets(360 * MIB, 100 * MIB)
    plan = planned(smollm2_shape, recorded["cpu-smollm2"], budgets)
    disk = plan.config.disk
    assert disk.is_active and disk.cpu_memory_gb == pytest.approx(0.09)
    assert plan.chosen.host_bytes <= budgets.host_bytes
    assert plan.chosen.device_bytes <= budgets.device_bytes
    assert plan.chosen.layout.disk_bytes > 0 and plan.chosen.time.disk_s > 0


def test_nothing_fits_is_one_clear_error(recorded, smollm2_shape, planned):
    with pytest.raises(ModelError, match=r"no placement fits: the device budget is 50\.0 MiB"):
        planned(smollm2_shape, recorded["cpu-smollm2"], Budgets(50 * MIB, GIB), [1, 2])


def _hand_layouts(shape, host_bytes, needed_bytes):
    """What people try: vLLM's prefetch flags over a grid (steps beyond the planner's
    own), and UVA of what is needed and more."""
    for group, share, step in itertools.product((1, 2, 4, 8, 32), (1, 2, 4), (1, 2, 4, 8)):
        num = max(1, min(group, group * share // 4))
        yield layouts.prefetch(shape, group, num, step, host_bytes, "direct")
    for extra_gib in (0, 0.5, 1, 2):
        found = layouts.uva(shape, needed_bytes + int(extra_gib * GIB))
        if found is not None:
            yield found


@pytest.mark.parametrize(
    ("figures", "shape", "device_gib", "host_gib"),
    [
        ("h100-llama-3-8b", "llama8b_shape", 12, 128),
        ("h100-llama-3-8b", "llama8b_shape", 8, 128),
        ("h100-llama-3-8b", "llama8b_shape", 8, 4),
        ("cpu-smollm2", "smollm2_shape", 0.45, 20),
        ("cpu-smollm2", "smollm2_shape", 0.35, 0.1),
    ],
)
def test_no_hand_setting_beats_the_plan(recorded, request, figures, shape, device_gib, host_gib):
    shape = request.getfixturevalue(shape)
    measured = recorded[figures]
    budgets = Budgets(int(device_gib * GIB), int(host_gib * GIB))
    best = candidates(shape, measured, budgets, measured.batch_sizes)[0]
    needed = shape.weight_bytes - budgets.device_bytes // 2
    tried = 0
    for layout in _hand_layouts(shape, budgets.host_bytes, needed):
        for batch, kv_offload in itertools.product(measured.batch_sizes, (False, True)):
            hand = evaluate(shape, measured, budgets, layout, batch, kv_offload)
            if hand is not None:
                tried += 1
                assert hand.tokens_per_s <= best.tokens_per_s * (1 + 1e-9), hand.label
    assert tried > 10


def test_experts_read_in_place_where_a_batch_touches_few(recorded, moe_shape):
    assert moe_shape.num_experts == 64
    assert moe_shape.expert_bytes[0] > 0.9 * moe_shape.layer_bytes[0]
    budgets = Budgets(moe_shape.weight_bytes // 2, HOST)
    best = candidates(moe_shape, recorded["h100-llama-3-8b"], budgets, [1])[0]
    # 2 of 64 experts a token: a step reads ~3% of the experts in place, not all of them.
    assert best.layout.experts_only and best.layout.config.uva.cpu_offload_params == {"experts"}


def test_on_a_cpu_warm_checkpoint_pages_are_mapped(recorded, smollm2_shape, monkeypatch):
    from offload.config import parts as config_parts

    # The disk tier's "mmap" mode, where this version of the config has it or not.
    monkeypatch.setattr(config_parts, "DISK_IO", (*config_parts.DISK_IO, "mmap"))
    modes = ("direct", "mmap")
    cold = Budgets(360 * MIB, 100 * MIB, page_cache_bytes=0)
    warm = Budgets(360 * MIB, 100 * MIB, page_cache_bytes=GIB)
    measured = recorded["cpu-smollm2"]
    direct = candidates(smollm2_shape, measured, cold, [1, 2], modes)[0]
    mapped = candidates(smollm2_shape, measured, warm, [1, 2], modes)[0]
    assert direct.layout.config.disk.disk_io == "direct" and direct.time.disk_s > 0
    assert mapped.layout.config.disk.disk_io == "mmap" and "mapped" in mapped.layout.places
    assert mapped.time.disk_s == 0 and mapped.tokens_per_s > direct.tokens_per_s
    # On a GPU nothing is mapped: its kernels cannot compute on the page cache.
    on_gpu = candidates(smollm2_shape, recorded["h100-llama-3-8b"], warm, [1], modes)
    assert on_gpu and all(c.layout.config.disk.disk_io != "mmap" for c in on_gpu)
