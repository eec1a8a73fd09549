"""`TransferStats`: running totals add, one call's figures subtract, and it prints readably."""

from offload.engine.kv_cache import KVStats
from offload.engine.transfer_stats import TransferStats
from offload.memory.copy_engine import CopyStats
from offload.offloader.stats import DiskStats, OffloadStats


def test_totals_add_and_subtract_field_by_field():
    before = TransferStats(weight_copied_bytes=10, kv_copied_bytes=2, stall_s=0.5, num_forwards=1)
    call = TransferStats(3, 4, 5, 0.25, 1, 2)
    after = before + call
    assert after == TransferStats(13, 6, 5, 0.75, 1, 3)
    assert after - before == call
    assert call.kv_moved_bytes == 9
    assert call.as_dict()["kv_written_back_bytes"] == 5


def test_counters_of_the_offloaders_are_bytes_only():
    weights = OffloadStats(copies=CopyStats(bytes_copied=7, stall_s=1.0))
    kv = KVStats(copies=CopyStats(bytes_copied=8), bytes_written_back=9)
    stats = TransferStats.of(weights, kv)
    assert stats == TransferStats(weight_copied_bytes=7, kv_copied_bytes=8, kv_written_back_bytes=9)
    assert TransferStats.of() == TransferStats()
    disk = DiskStats(bytes_read=5, read_s=2.0, stall_s=0.5, bytes_mapped=6)
    stats = TransferStats.of(OffloadStats(disk=disk))
    assert (stats.disk_read_bytes, stats.disk_read_s, stats.disk_stall_s) == (5, 2.0, 0.5)
    assert stats.disk_mapped_bytes == 6


def test_repr_reads_with_units():
    text = repr(TransferStats(weight_copied_bytes=3 * 2**20, stall_s=0.012, num_forwards=4))
    assert text == (
        "TransferStats(weights copied 3.0 MiB, KV cache copied 0.0 MiB and written back "
        "0.0 MiB, stall 12 ms, 0 graph replays, 4 forwards)"
    )
