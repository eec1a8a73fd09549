"""The fault-injection sweep of `test_fault_injection.py` over a streamed forward: a
Ctrl-C at every interruptible instruction of the prefetch protocol and of the disk tier's
own code (placing reads, waiting, draining), then the next forward must be exact."""

from __future__ import annotations

import time

import pytest
import test_fault_injection as sweep
import torch
import zoo
from engines import SlowEngine

from offload.memory import disk_layout, disk_reader, mapped_files
from offload.model.loader import load_model
from offload.offloader import disk_tier, factory, sources
from offload.offloader.disk_tier import ReadHooks

DISK_SOURCES = (sources.DirectRead, sources.StagedRead, sources.MappedRead, sources.DiskSource)
DISK_CODE = sweep._code_objects(
    disk_tier.DiskTier,
    *DISK_SOURCES,
    disk_reader.DiskReader,
    disk_layout.PendingMoves,
    mapped_files.MappedFiles,
) - {disk_tier.DiskTier.stats.__code__, *(source.stats.__code__ for source in DISK_SOURCES)}


@pytest.mark.parametrize(("layers_in_ram", "io"), [(0, "direct"), (2, "direct"), (2, "mmap")])
def test_an_interrupt_at_any_step_of_a_streamed_forward_leaves_the_next_forward_exact(
    tmp_path, monkeypatch, layers_in_ram, io
):
    base = zoo.build("llama", num_layers=5)
    base.save_pretrained(tmp_path, max_shard_size="60KB")  # read: weights moved to homes
    if io == "mmap":
        zoo.realign(tmp_path)  # (a mapping needs aligned weights)
    ids = zoo.inputs()
    expected = zoo.logits(base, ids)
    layer = zoo.layer_param_bytes(base) / 5
    budget = (layers_in_ram + 0.5) * layer / 2**30 if layers_in_ram else 0
    config = {
        "offload_group_size": 1,
        "offload_prefetch_step": 2,
        "cpu_memory_gb": budget,
        "disk_io": io,
    }
    monkeypatch.setattr(sweep, "PROTOCOL", sweep.PROTOCOL | DISK_CODE)
    moved, opened = [], []

    def make():
        for offloader in opened:  # end the I/O threads of the models done with
            offloader.close()
        opened.clear()
        hooks = ReadHooks(delay_s=0.0002)  # reads still in flight at a Ctrl-C
        model, offloader = load_model(tmp_path, {**config, "read_ahead": 1}, read_hooks=hooks)
        opened.append(offloader)
        counter = (lambda s: s.disk.bytes_mapped) if io == "mmap" else (lambda s: s.disk.bytes_read)
        return sweep.forwards_and_check(model, offloader, ids, expected, moved, counter)

    assert sweep._sweep(make, every=False) > 30
    assert min(moved) > 0
    for offloader in opened:
        offloader.close()


def test_a_copy_left_in_flight_by_an_interrupt_never_lands_over_a_later_read(tmp_path, monkeypatch):
    """Units in RAM are copied into their slots by the copy engine, units on disk read
    straight into theirs, and a slot serves both. A Ctrl-C while a read is awaited can
    leave a copy queued (here: unit 4's, into the slot unit 1 shares); the next forward
    reads unit 1 into that slot, and the old copy must not land over it."""
    base = zoo.build("llama", num_layers=5)
    base.save_pretrained(tmp_path, max_shard_size="60KB")
    ids = zoo.inputs()
    expected = zoo.logits(base, ids)
    budget = 2.5 * zoo.layer_param_bytes(base) / 5 / 2**30  # two layers in RAM
    config = {"offload_group_size": 1, "offload_prefetch_step": 2, "cpu_memory_gb": budget}
    monkeypatch.setattr(factory, "make_copy_engine", lambda device: SlowEngine(delay_s=0.2))
    model, offloader = load_model(tmp_path, {**config, "disk_io": "direct"})
    try:
        on_disk = [unit.disk is not None for unit in offloader._layers]
        assert on_disk == [True, True, False, True, False]  # slots: (0, 3), (1, 4), (2,)
        real_wait, calls = sources.DirectRead.wait, []

        def interrupt_at_unit_3(source, ticket):
            calls.append(ticket)
            if len(calls) == 3:  # units 0 and 1 ran: unit 4's copy into slot 1 is queued
                raise KeyboardInterrupt
            real_wait(source, ticket)

        def slow_wait(source, ticket):
            real_wait(source, ticket)
            calls.append(ticket)
            if len(calls) == 5:  # unit 1 is in slot 1: a copy still queued lands now
                time.sleep(0.3)

        monkeypatch.setattr(sources.DirectRead, "wait", interrupt_at_unit_3)
        with pytest.raises(KeyboardInterrupt):
            zoo.logits(model, ids)
        monkeypatch.setattr(sources.DirectRead, "wait", slow_wait)
        assert torch.equal(zoo.logits(model, ids), expected)
    finally:
        offloader.close()
