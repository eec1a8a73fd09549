"""The disk tier inside a process budget (what `LLM` asks on a CPU): kept layers, slots
and the pages of mapped checkpoint files that a forward touches all fit the RAM the
budget leaves the layer stack, and the outputs stay the resident model's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as tf
import zoo

from offload.errors import ModelError
from offload.model.loader import load_model
from offload.offloader import disk_tier

NUM_LAYERS = 4
EVERY_LAYER = {"offload_group_size": 1, "offload_num_in_group": 1, "offload_prefetch_step": 2}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A small Llama (2.6 MB layers: many pages each) in shards that layers span, and its
    layers' size."""
    path = tmp_path_factory.mktemp("stack-budget")
    config = tf.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=zoo.VOCAB,
    )
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).eval()
    model.save_pretrained(path, max_shard_size="3MB")
    zoo.realign(path)  # (mapped: weights aligned in their files)
    return path, model, zoo.layer_param_bytes(model) // NUM_LAYERS


def mapped_rss_bytes(folder: Path) -> int:
    """This process's resident pages of mappings of files in `folder` (/proc/self/smaps)."""
    total, counting = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            counting = len(fields) >= 6 and fields[5].startswith(str(folder))
        elif counting and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def test_mapped_layers_take_the_held_ones_and_one_at_a_time(saved):
    """The page cache holds the files (just written): "auto" maps them. A budget of 2.5
    layers holds one layer's pages for good and streams the others, whose pages leave the
    process once each has run: after a forward, only the held layer's are resident."""
    path, resident, layer_bytes = saved
    budget = int(2.5 * layer_bytes)
    config = {**EVERY_LAYER, "cpu_memory_gb": 0, "disk_io": "auto"}
    model, offloader = load_model(path, config, stack_budget_bytes=budget)
    ids = zoo.inputs()
    assert torch.equal(zoo.logits(model, ids), zoo.logits(resident, ids))
    assert torch.equal(zoo.greedy(model, ids), zoo.greedy(resident, ids))
    stats = offloader.stats()
    assert stats.disk.io == "mmap"
    assert stats.disk.ram_bytes <= budget and stats.host_bytes == 0
    assert stats.device_staging_bytes == 0  # mapped units need no slot
    # (The kernel maps up to 64 KiB around a faulting page: some neighbours' pages too.)
    assert mapped_rss_bytes(path) <= layer_bytes + 2**20  # (without the drop: all layers)
    offloader.close()


def test_a_cold_page_cache_reads_into_slots_and_keeps_layers_within_the_budget(saved, monkeypatch):
    """Nothing of the files in the page cache: "auto" reads around it into the slot
    ring, and the layers kept in host slabs fill what the slots leave of the budget."""
    path, resident, layer_bytes = saved
    monkeypatch.setattr(disk_tier, "cached_fraction", lambda ranges: 0.0)
    monkeypatch.setattr(disk_tier, "available_ram_bytes", lambda: layer_bytes)  # (no room)
    budget = int(4.5 * layer_bytes)  # 3 slots (read ahead 2), then room for a layer
    config = {**EVERY_LAYER, "cpu_memory_gb": 0, "disk_io": "auto"}
    model, offloader = load_model(path, config, stack_budget_bytes=budget)
    ids = zoo.inputs()
    assert torch.equal(zoo.logits(model, ids), zoo.logits(resident, ids))
    stats = offloader.stats()
    assert stats.disk.io == "direct"
    assert stats.disk.num_units == NUM_LAYERS - 1
    assert stats.host_bytes + stats.device_staging_bytes <= stats.disk.ram_bytes <= budget
    assert mapped_rss_bytes(path) == 0
    offloader.close()


def test_a_cold_page_cache_with_room_for_the_files_maps_them(saved, monkeypatch):
    """Nothing of the files in the page cache, but the RAM available holds them many times:
    "auto" maps them (the page cache keeps them after the first forward), still within
    the budget."""
    path, resident, layer_bytes = saved
    monkeypatch.setattr(disk_tier, "cached_fraction", lambda ranges: 0.0)
    monkeypatch.setattr(disk_tier, "available_ram_bytes", lambda: 100 * NUM_LAYERS * layer_bytes)
    budget = int(2.5 * layer_bytes)
    config = {**EVERY_LAYER, "cpu_memory_gb": 0, "disk_io": "auto"}
    model, offloader = load_model(path, config, stack_budget_bytes=budget)
    ids = zoo.inputs()
    assert torch.equal(zoo.logits(model, ids), zoo.logits(resident, ids))
    assert offloader.stats().disk.io == "mmap"
    assert mapped_rss_bytes(path) <= layer_bytes + 2**20
    offloader.close()


def test_mmap_asked_beyond_the_budget_is_refused_with_the_numbers(saved):
    path, _, layer_bytes = saved
    config = {**EVERY_LAYER, "cpu_memory_gb": 0, "disk_io": "mmap"}
    refused = r"disk_io='mmap': the layer stack needs at least \d+ MiB .*mapped pages.*leaves it"
    with pytest.raises(ModelError, match=refused):
        load_model(path, config, stack_budget_bytes=layer_bytes // 2)
    _, offloader = load_model(path, config, stack_budget_bytes=layer_bytes * 2)
    assert offloader.stats().disk.io == "mmap"
    offloader.close()
