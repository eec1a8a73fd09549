"""The cost model on table cases: each row a pipeline whose step time is known by hand."""

import math

import pytest

from offload.planner.cost import LayerCost, Rates, predict_step, touched_share, transfer_s

MS = 1e-3
GPU = Rates(on_gpu=True, link_gb_per_s=1.0, disk_gb_per_s=0.5, uva_gb_per_s=0.5)
CPU = Rates(on_gpu=False, link_gb_per_s=1.0, disk_gb_per_s=0.5)
MB_MS = 10**6  # one millisecond of the 1 GB/s link


# machine, place of every layer, layers, compute ms and bytes (in ms of the 1 GB/s link)
# of each, slots, the step in ms by hand; and what the row shows.
CASES = """
gpu host   4 1   0.5  2  4   copies overlap compute: the step is the larger of the two
gpu host   4 1   2    2  8   link-bound: the copies back to back
gpu host   4 1   1    1  8   step 1: a copy starts only once the layer before it ran
gpu host   4 1   1    2  4   step 2: each copy runs beside the layer before it
cpu host   4 1   0.5  2  6   a CPU copies on its compute cores: compute + copies
cpu mapped 4 1   5    3  4   mapped files in a warm page cache: nothing beyond compute
cpu disk   6 1   1    3  12  O_DIRECT reads beside compute, bound by the disk (2 ms each)
cpu disk   6 1   0.25 3  6   reads hidden behind compute
gpu disk   6 0.1 1    3  12  a GPU reads, then copies in: the slower, the disk, sets the pace
cpu disk   4 1   1    3  6   four layers, three slots: two slots keep their only layer
gpu uva    2 1   1    1  6   UVA reads at 0.5 GB/s lengthen the layer: 2 ms a MB
cpu uva    2 1   1    1  2   on a CPU host memory is the device's: nothing to read over
gpu host   2 1   5    2  2   two layers in two slots: loaded once, never again
"""


@pytest.mark.parametrize("row", CASES.strip().splitlines())
def test_step_time(row):
    machine, place, count, compute_ms, link_ms, step, expected_ms = row.split()[:7]
    layer = LayerCost(float(compute_ms) * MS, place, int(float(link_ms) * MB_MS))
    rates = GPU if machine == "gpu" else CPU
    predicted = predict_step([layer] * int(count), 0.0, rates, prefetch_step=int(step))
    assert predicted.step_s == pytest.approx(float(expected_ms) * MS, rel=1e-9)


def test_a_cpu_computing_slows_its_disk_reads():
    # Reads at 0.25 GB/s while the CPU computes, 0.5 GB/s alone: each 1 ms layer costs the
    # disk 0.5 ms, so a disk-bound layer takes 2 + 0.5 ms (a GPU's reads are not slowed).
    layers = [LayerCost(MS, "disk", MB_MS)] * 6
    busy = Rates(on_gpu=False, link_gb_per_s=1.0, disk_gb_per_s=0.5, disk_busy_gb_per_s=0.25)
    slowed = predict_step(layers, 0.0, busy, prefetch_step=3)
    assert slowed.step_s == pytest.approx(15 * MS)
    assert slowed.disk_s == pytest.approx(15 * MS)
    assert predict_step(layers, 0.0, CPU, prefetch_step=3).step_s == pytest.approx(12 * MS)
    gpu = Rates(on_gpu=True, link_gb_per_s=100.0, disk_gb_per_s=0.5, disk_busy_gb_per_s=0.25)
    assert predict_step(layers, 0.0, gpu, prefetch_step=3).step_s == pytest.approx(12 * MS, 1e-2)


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
    layers = [LayerCost(MS, "host", 2 * MB_MS)] * 4
    predicted = predict_step(layers, 3 * MS, GPU, prefetch_step=2)
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
    predicted = predict_step([LayerCost(2 * MS)] * 3, MS, GPU, prefetch_step=4)
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
