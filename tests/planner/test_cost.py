"""The cost model on table cases: each row a pipeline whose step time is known by hand."""

import math

import pytest

from offload.planner.cost import LayerCost, Rates, predict_step, touched_share, transfer_s

MS = 1e-3
GPU = Rates(on_gpu=True, link_gb_per_s=1.0, disk_gb_per_s=0.5, uva_gb_per_s=0.5)
CPU = Rates(on_gpu=False, link_gb_per_s=1.0, disk_gb_per_s=0.5)
MB_MS = 10**6  # one millisecond of the 1 GB/s link


def _layers(place: str, count: int, compute_ms: float, link_ms: float) -> list[LayerCost]:
    return [LayerCost(compute_ms * MS, place, int(link_ms * MB_MS)) for _ in range(count)]


@pytest.mark.parametrize(
    ("case", "layers", "rates", "step", "expected_ms"),
    [
        # GPU: copies overlap compute; the step is the larger of the two.
        ("gpu compute-bound", _layers("host", 4, 1, 0.5), GPU, 2, 4),
        ("gpu link-bound", _layers("host", 4, 1, 2), GPU, 2, 8),
        # Step 1: a layer's copy starts only once the layer before it ran: no overlap.
        ("gpu stall with step 1", _layers("host", 4, 1, 1), GPU, 1, 8),
        ("gpu no stall with step 2", _layers("host", 4, 1, 1), GPU, 2, 4),
        # CPU: the copy takes a core from compute: compute + copy.
        ("cpu serial copies", _layers("host", 4, 1, 0.5), CPU, 2, 6),
        # Mapped checkpoint files (warm page cache): nothing beyond compute.
        ("cpu mapped disk is free", _layers("mapped", 4, 1, 5), CPU, 3, 4),
        # Cold disk with O_DIRECT: reads beside compute, bound by the disk (2 ms a layer).
        ("cpu cold disk bound", _layers("disk", 6, 1, 1), CPU, 3, 12),
        ("cpu cold disk hidden", _layers("disk", 6, 1, 0.25), CPU, 3, 6),
        # GPU disk: read, then copied in; the slower of disk and link sets the pace.
        ("gpu disk then link", _layers("disk", 6, 0.1, 1), GPU, 3, 12),
        # Four layers in three slots: two slots have one occupant, loaded once.
        ("cpu disk slots that stay", _layers("disk", 4, 1, 1), CPU, 3, 6),
        # UVA: the layer reads its bytes over the link as it runs (0.5 GB/s: 2 ms a MB).
        ("gpu uva lengthens compute", _layers("uva", 2, 1, 1), GPU, 1, 6),
        ("cpu uva is host memory", _layers("uva", 2, 1, 1), CPU, 1, 2),
        # Two offloaded layers in two slots: each slot's only occupant is loaded once.
        ("slots holding everything", _layers("host", 2, 1, 5), GPU, 2, 2),
    ],
)
def test_step_time(case, layers, rates, step, expected_ms):
    predicted = predict_step(layers, 0.0, rates, prefetch_step=step)
    assert predicted.step_s == pytest.approx(expected_ms * MS, rel=1e-9), case


def test_resident_layers_give_the_copies_time():
    # Of every two layers the second is offloaded; its 1.5 ms copy hides behind the
    # resident layer before it and the offloaded one two slots back.
    layers = [
        LayerCost(MS, "resident") if i % 2 == 0 else LayerCost(MS, "host", int(1.5 * MB_MS))
        for i in range(8)
    ]
    assert predict_step(layers, 0.0, GPU, prefetch_step=2).step_s == pytest.approx(8 * MS)
    # With one slot a copy issued after layer 1 must land before layer 3: 1 ms apart.
    one_slot = predict_step(layers, 0.0, GPU, prefetch_step=1)
    assert one_slot.step_s == pytest.approx(10 * MS)
    assert one_slot.stall_s == pytest.approx(2 * MS)


def test_parts_of_a_step():
    predicted = predict_step(_layers("host", 4, 1, 2), 3 * MS, GPU, prefetch_step=2)
    assert predicted.compute_s == pytest.approx(7 * MS)
    assert predicted.link_s == pytest.approx(8 * MS)
    assert predicted.disk_s == 0
    assert predicted.limit == "link"
    assert predicted.bound_s == pytest.approx(8 * MS)
    # The head (3 ms) hides part of the next forward's first copies.
    assert predicted.step_s == pytest.approx(9 * MS)


def test_kv_cache_in_host_memory_uses_the_copy_queue():
    layers = [LayerCost(MS, kv_bytes=2 * MB_MS) for _ in range(4)]
    gpu = predict_step(layers, 0.0, GPU)
    assert gpu.link_s == pytest.approx(8 * MS) and gpu.step_s == pytest.approx(8 * MS)
    cpu = predict_step(layers, 0.0, CPU)
    assert cpu.step_s == pytest.approx(12 * MS)  # copied on the compute cores


def test_everything_resident_is_compute():
    predicted = predict_step(_layers("resident", 3, 2, 0), MS, GPU, prefetch_step=4)
    assert predicted.step_s == pytest.approx(7 * MS)
    assert predicted.stall_s == 0 and predicted.limit == "compute"


@pytest.mark.parametrize(
    ("experts", "per_token", "batch", "share"),
    [(8, 2, 1, 0.25), (8, 2, 2, 1 - 0.75**2), (64, 8, 1000, 1.0), (0, 0, 4, 1.0), (4, 4, 1, 1.0)],
)
def test_touched_share(experts, per_token, batch, share):
    assert touched_share(experts, per_token, batch) == pytest.approx(share, abs=1e-12)


def test_bad_inputs_say_what_is_allowed():
    with pytest.raises(ValueError, match="place must be one of resident, host"):
        LayerCost(1.0, "gpu")
    with pytest.raises(ValueError, match="must be >= 0"):
        LayerCost(-1.0)
    with pytest.raises(ValueError, match="prefetch_step and kv_slots must be >= 1"):
        predict_step([], 0.0, GPU, prefetch_step=0)
    assert transfer_s(1, 0.0) == math.inf and transfer_s(0, 0.0) == 0.0
