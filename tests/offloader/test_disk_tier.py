"""The disk tier: layers that do not fit the host budget stream from the model's own
safetensors files, and the outputs are the resident model's, bit for bit."""

from __future__ import annotations

import errno
import json
import os
import threading

import file_faults
import pytest
import torch
import zoo
from pagecache import cached_bytes

import offload
from offload.errors import ModelError
from offload.memory import disk_reader
from offload.memory.disk_reader import DiskReadError
from offload.model.loader import load_model
from offload.offloader import disk_tier
from offload.offloader.disk_tier import ReadHooks
from offload.offloader.sources import DirectRead, MappedRead

NUM_LAYERS = 6
EVERY_LAYER = {"offload_group_size": 1, "offload_num_in_group": 1, "offload_prefetch_step": 2}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A tiny Llama saved in several shards, so that layers span files."""
    path = tmp_path_factory.mktemp("sharded")
    model = zoo.build("llama", num_layers=NUM_LAYERS)
    model.save_pretrained(path, max_shard_size="60KB")
    assert len(list(path.glob("*.safetensors"))) > 2
    return path, model


@pytest.fixture(scope="module")
def aligned(sharded, tmp_path_factory):
    """The same shards rewritten with every tensor 64-byte aligned in its file, as a
    mapping needs (`sharded` is as the safetensors library writes: 8-byte aligned, so the
    disk tier's reads move each weight to an aligned home)."""
    source, model = sharded
    return zoo.realign(_copy_of(source, tmp_path_factory.mktemp("aligned"))), model


def _of(io, sharded, aligned):
    """The checkpoint a test of `io` runs on: a mapping needs aligned files."""
    return aligned if io in ("mmap", "auto") else sharded


def _layer_bytes(model) -> int:
    return zoo.layer_param_bytes(model) // NUM_LAYERS


def _budgets(model) -> dict[str, float]:
    layer = _layer_bytes(model)  # half a layer more: room for the slabs' alignment
    return {
        "none": 0.0,
        "half": (NUM_LAYERS // 2 + 0.5) * layer / 2**30,
        "all but one": (NUM_LAYERS - 0.5) * layer / 2**30,
    }


@pytest.mark.parametrize("budget", ["none", "half", "all but one"])
@pytest.mark.parametrize("read_ahead", [1, 3])
@pytest.mark.parametrize("io", ["direct", "page-cache", "mmap"])
def test_streamed_layers_give_the_resident_logits_and_tokens(
    sharded, aligned, budget, read_ahead, io
):
    path, resident = _of(io, sharded, aligned)
    ids = zoo.inputs()  # a batch of two
    config = {
        **EVERY_LAYER,
        "cpu_memory_gb": _budgets(resident)[budget],
        "read_ahead": read_ahead,
        "disk_io": io,
    }
    model, offloader = load_model(path, config)
    assert torch.equal(zoo.logits(model, ids), zoo.logits(resident, ids))
    assert torch.equal(zoo.greedy(model, ids), zoo.greedy(resident, ids))
    stats = offloader.stats()
    on_disk = {"none": NUM_LAYERS, "half": NUM_LAYERS // 2, "all but one": 1}[budget]
    assert stats.disk.num_units == on_disk
    assert stats.host_bytes <= config["cpu_memory_gb"] * 2**30
    assert stats.disk.io == io
    streamed = stats.disk.bytes_mapped if io == "mmap" else stats.disk.bytes_read
    assert streamed >= on_disk * _layer_bytes(resident)
    if io == "mmap":  # computed on in place: no read, and no slot when all are mapped
        assert stats.disk.bytes_read == 0
        assert (stats.device_staging_bytes == 0) == (budget == "none")
    offloader.close()


@pytest.mark.parametrize("io", ["auto", "direct"])
def test_apply_streams_a_from_pretrained_model_from_its_own_files(sharded, aligned, io):
    """By default ("auto"), a checkpoint in the page cache (just loaded) is mapped."""
    path, resident = _of(io, sharded, aligned)
    model = zoo.load_on_cpu(path)
    offloader = offload.apply(model, {**EVERY_LAYER, "cpu_memory_gb": 0, "disk_io": io})
    ids = zoo.inputs()
    assert torch.equal(zoo.logits(model, ids), zoo.logits(resident, ids))
    stats = offloader.stats()
    assert stats.disk.io == ("mmap" if io == "auto" else io)
    assert (stats.disk.bytes_mapped if io == "auto" else stats.disk.bytes_read) > 0
    assert offloader.host_bytes == 0
    offloader.close()


@pytest.mark.parametrize("staged", [False, True])
def test_delayed_reads_still_give_the_resident_logits(sharded, staged):
    """Also the GPU's path, run on the CPU: each read lands in a staging buffer and a
    staging thread queues the copy into the slot."""
    path, resident = sharded
    config = {**EVERY_LAYER, "cpu_memory_gb": 0, "read_ahead": 2, "disk_io": "direct"}
    hooks = ReadHooks(delay_s=0.02, force_staging=staged)  # (slow enough to stall a loaded CPU)
    model, offloader = load_model(path, config, read_hooks=hooks)
    ids = zoo.inputs()
    assert torch.equal(zoo.logits(model, ids), zoo.logits(resident, ids))
    stats = offloader.stats()
    assert stats.disk.num_stalls > 0  # compute did wait for slow reads
    assert (stats.disk.staging_bytes > 0) == staged
    assert torch.equal(zoo.greedy(model, ids), zoo.greedy(resident, ids))
    offloader.close()


@pytest.mark.parametrize("io", ["direct", "mmap"])
def test_through_torch_compile(sharded, aligned, io):
    path, resident = _of(io, sharded, aligned)
    model, offloader = load_model(path, {**EVERY_LAYER, "cpu_memory_gb": 0, "disk_io": io})
    compiled = torch.compile(model, backend="eager")
    ids = zoo.inputs()
    with torch.no_grad():
        out = compiled(input_ids=ids).logits
    assert torch.equal(out, zoo.logits(resident, ids))
    offloader.close()


@pytest.mark.parametrize("io", ["direct", "mmap"])
def test_state_dict_reads_streamed_weights_from_the_checkpoint(sharded, aligned, io):
    path, resident = _of(io, sharded, aligned)
    model, offloader = load_model(path, {**EVERY_LAYER, "cpu_memory_gb": 0, "disk_io": io})
    expected = resident.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    offloader.close()


def _faults():
    def truncate(path):
        os.truncate(path, path.stat().st_size // 2)

    def overwrite(path):  # in place, the size and the inode kept
        with path.open("r+b") as file:
            file.seek(path.stat().st_size // 2)
            file.write(b"\x7f" * 64)

    return {
        **file_faults.COMMON,
        "truncated": truncate,
        "overwritten": overwrite,
    }


def _copy_of(source, tmp_path):
    for item in source.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    return tmp_path


@pytest.mark.parametrize("io", ["direct", "mmap"])
@pytest.mark.parametrize("fault", sorted(_faults()))
def test_a_checkpoint_changed_while_running_is_one_error_naming_the_file(
    sharded, aligned, tmp_path, fault, io
):
    source, resident = _of(io, sharded, aligned)
    _copy_of(source, tmp_path)
    model, offloader = load_model(tmp_path, {**EVERY_LAYER, "cpu_memory_gb": 0, "disk_io": io})
    ids = zoo.inputs()
    assert torch.equal(zoo.logits(model, ids), zoo.logits(resident, ids))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = tmp_path / index["weight_map"]["model.layers.3.mlp.up_proj.weight"]
    _faults()[fault](victim)
    # Reads done before the change stay right; from the first forward that reads the
    # file after it, every forward fails, naming it; never a wrong answer.
    failures = 0
    for _ in range(3):
        try:
            assert torch.equal(zoo.logits(model, ids), zoo.logits(resident, ids))
        except DiskReadError as error:
            assert str(victim) in str(error)
            failures += 1
    assert failures >= 2
    if io == "mmap":
        threads = [offloader._disk._source._mapped._watcher]  # the lease watcher has ended
    else:
        threads = list(offloader._disk._source._reader._pool._threads)  # the I/O threads ended
    for thread in threads:
        thread.join(timeout=5)
    assert threads and not any(t.is_alive() for t in threads)
    offloader.close()


def test_state_dict_reads_every_streamed_weight_with_one_reader(sharded, monkeypatch):
    """Not a reader (a thread pool) per tensor: one, kept for every value read."""
    path, _ = sharded
    model, offloader = load_model(path, {**EVERY_LAYER, "cpu_memory_gb": 0, "disk_io": "direct"})
    made = []

    class Counted(disk_tier.DiskReader):
        def __init__(self, *args, **kwargs):
            made.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(disk_tier, "DiskReader", Counted)
    model.state_dict()
    model.state_dict()
    assert len(made) == 1
    offloader.close()


def test_a_read_error_is_one_error_naming_the_file(sharded, monkeypatch):
    path, _ = sharded
    model, offloader = load_model(path, {**EVERY_LAYER, "cpu_memory_gb": 0, "disk_io": "direct"})

    def failing(*args):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(disk_reader.os, "preadv", failing)
    with pytest.raises(
        DiskReadError, match=r"reading .*model-.*\.safetensors failed: Input/output"
    ):
        zoo.logits(model, zoo.inputs())
    offloader.close()


@pytest.mark.parametrize("staged", [False, True])
def test_after_a_read_error_the_next_forward_reads_again_and_is_exact(sharded, monkeypatch, staged):
    """A failing read (EIO) fails its forward; once the disk reads again, the next
    forward loads every slot again and gives the resident logits (a server stays up)."""
    path, resident = sharded
    hooks = ReadHooks(force_staging=staged)
    config = {**EVERY_LAYER, "cpu_memory_gb": 0, "disk_io": "direct"}
    model, offloader = load_model(path, config, read_hooks=hooks)
    ids = zoo.inputs()
    expected = zoo.logits(resident, ids)
    real = disk_reader.os.preadv
    calls = {"n": 0}

    def failing_once_in_a_while(*args):
        calls["n"] += 1
        if calls["n"] == 3:  # mid-forward: some units read, some not
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(*args)

    monkeypatch.setattr(disk_reader.os, "preadv", failing_once_in_a_while)
    with pytest.raises(DiskReadError, match="Input/output"):
        zoo.logits(model, ids)
    assert torch.equal(zoo.logits(model, ids), expected)
    assert torch.equal(zoo.logits(model, ids), expected)
    offloader.close()


@pytest.mark.parametrize(
    ("budget", "io"), [("none", "direct"), ("half", "direct"), ("half", "mmap")]
)
def test_an_interrupted_streamed_forward_leaves_the_model_usable(
    sharded, aligned, monkeypatch, budget, io
):
    """A Ctrl-C while compute waits for a read leaves that read in flight; it must land
    (its moves to aligned homes done) before anything else is loaded into its slot (a
    unit from host memory, with a budget)."""
    path, resident = _of(io, sharded, aligned)
    gib = _budgets(resident)[budget]
    config = {**EVERY_LAYER, "cpu_memory_gb": gib, "read_ahead": 2, "disk_io": io}
    model, offloader = load_model(path, config, read_hooks=ReadHooks(delay_s=0.03))  # in flight
    ids = zoo.inputs()
    expected = zoo.logits(resident, ids)
    waits = {"count": 0, "at": 0}  # interrupt the `at`-th wait of a forward (0: never)
    source = {"direct": DirectRead, "mmap": MappedRead}[io]  # where units on disk wait
    original = source.wait

    def interrupting(self, ticket):
        waits["count"] += 1
        if waits["count"] == waits["at"]:
            raise KeyboardInterrupt
        return original(self, ticket)

    monkeypatch.setattr(source, "wait", interrupting)
    for at in range(1, offloader.stats().disk.num_units + 1):
        waits.update(count=0, at=at)
        with pytest.raises(KeyboardInterrupt):
            zoo.logits(model, ids)
        waits.update(count=0, at=0)
        assert torch.equal(zoo.logits(model, ids), expected), f"wrong after wait {at}"
    offloader.close()


def test_recovering_from_an_abandoned_forward_waits_for_its_reads_in_flight(sharded, monkeypatch):
    """Deterministic twin of the test above: a read is held while it writes into its
    slot; after a Ctrl-C in a wait, `recover` (what the next forward runs first) returns
    only once that write is done, and reads not started then never write."""
    path, resident = sharded
    config = {**EVERY_LAYER, "cpu_memory_gb": 0, "read_ahead": 2, "disk_io": "direct"}
    model, offloader = load_model(path, config)
    armed, gate, writing = threading.Event(), threading.Event(), threading.Event()
    pread = disk_reader.DiskReader._pread

    def held(self, *args):  # reads issued once armed are held while they write
        if armed.is_set():
            writing.set()
            gate.wait()
        return pread(self, *args)

    monkeypatch.setattr(disk_reader.DiskReader, "_pread", held)
    original, waits = DirectRead.wait, []

    def interrupted(self, ticket):
        waits.append(ticket)
        if len(waits) == 1:  # layer 0's read lands first (on a busy machine it may not
            done = original(self, ticket)  # have started yet, and would then be held)
            armed.set()  # from here on, what is read next is held
            return done
        if len(waits) == 2:  # layer 0 ran, and the read of layer 3 is writing, held
            assert writing.wait(timeout=10)
            raise KeyboardInterrupt
        return original(self, ticket)

    monkeypatch.setattr(DirectRead, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        zoo.logits(model, zoo.inputs())
    monkeypatch.setattr(DirectRead, "wait", original)
    recovering = threading.Thread(target=offloader.recover)
    recovering.start()
    recovering.join(timeout=0.3)
    assert recovering.is_alive()  # still waiting for the held write
    gate.set()
    recovering.join(timeout=10)
    assert not recovering.is_alive()
    assert torch.equal(zoo.logits(model, zoo.inputs()), zoo.logits(resident, zoo.inputs()))
    offloader.close()


@pytest.mark.parametrize("io", ["direct", "mmap"])
def test_smollm2_with_every_layer_on_disk_gives_transformers_tokens(io):
    from offload.model.default import default_model_path

    path = default_model_path()
    resident = zoo.load_on_cpu(path)
    model, offloader = load_model(path, {"cpu_memory_gb": 0, "disk_io": io})
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 2644, 47]])
    assert torch.equal(zoo.greedy(model, ids, 8), zoo.greedy(resident, ids, 8))
    stats = offloader.stats()
    assert stats.disk.num_units == 30 and stats.host_bytes == 0
    streamed = stats.disk.bytes_mapped if io == "mmap" else stats.disk.bytes_read
    assert streamed >= 8 * zoo.layer_param_bytes(resident)
    offloader.close()


def test_llm_streams_from_disk_and_reports_it(tmp_path):
    from offload import LLM, SamplingParams

    path = zoo.save_tiny_llm(tmp_path, num_layers=4)
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    prompts = ["t5 t9 t11", "t7"]

    def run(**flags):
        with LLM(path, **flags) as llm:
            outputs = llm.generate(prompts, greedy, use_tqdm=False)
            moved = llm.transfer_stats()
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs], moved

    resident, _ = run()
    streamed, moved = run(cpu_memory_gb=0, read_ahead=1, disk_io="page-cache")
    assert streamed == resident
    assert moved.disk_read_bytes > 0 and moved.weight_copied_bytes == 0
    assert "from disk" in repr(moved)
    zoo.realign(path)  # (a mapping needs aligned weights; reads move them to aligned homes)
    mapped, moved = run(cpu_memory_gb=0, disk_io="mmap")
    assert mapped == resident
    assert moved.disk_mapped_bytes > 0 and moved.disk_read_bytes == 0
    assert "of mapped checkpoint files" in repr(moved)


def test_direct_io_leaves_the_checkpoint_out_of_the_page_cache(sharded, tmp_path):
    """With disk_io="direct", neither loading (the layers kept in RAM, the resident
    weights) nor streaming leaves the checkpoint's bytes in the page cache (headers
    aside): the budget holds for the machine. Through the page cache, they stay."""
    source, resident = sharded
    for item in source.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    files = sorted(tmp_path.glob("*.safetensors"))

    def cached_after(io):
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        config = {**EVERY_LAYER, "cpu_memory_gb": _budgets(resident)["half"], "disk_io": io}
        model, offloader = load_model(tmp_path, config)
        zoo.logits(model, zoo.inputs())
        offloader.close()
        return sum(cached_bytes(path) for path in files)

    assert cached_after("direct") <= 4 * 4096 * len(files)  # headers, pages at tensor edges
    assert cached_after("page-cache") > sum(path.stat().st_size for path in files) // 2


def test_a_file_truncated_during_a_mapped_forward_is_held_then_an_error(aligned, tmp_path):
    """The writer waits while the forward reads the mapping (no SIGBUS, no wrong bytes);
    the forward fails at its next mapped layer, naming the file, and the writer goes on."""
    source, _ = aligned
    _copy_of(source, tmp_path)
    model, offloader = load_model(tmp_path, {**EVERY_LAYER, "cpu_memory_gb": 0, "disk_io": "mmap"})
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = tmp_path / index["weight_map"]["model.layers.4.mlp.up_proj.weight"]
    truncating = threading.Thread(target=os.truncate, args=(victim, 100))
    held = []

    def truncate_meanwhile(module, args):
        truncating.start()
        truncating.join(timeout=0.3)
        held.append(truncating.is_alive())

    hook = model.model.layers[1].register_forward_pre_hook(truncate_meanwhile)
    with pytest.raises(DiskReadError, match=str(victim)):
        zoo.logits(model, zoo.inputs())
    hook.remove()
    truncating.join(timeout=10)
    assert held == [True] and victim.stat().st_size == 100
    with pytest.raises(DiskReadError, match=str(victim)):
        zoo.logits(model, zoo.inputs())
    offloader.close()


def test_auto_maps_a_cached_checkpoint_and_reads_a_cold_one(aligned, tmp_path, monkeypatch):
    """(A cold one larger than half the RAM available: one that fits is mapped too,
    `test_stack_budget.py`.)"""
    source, resident = aligned
    monkeypatch.setattr(disk_tier, "available_ram_bytes", lambda: 0)
    files = sorted(_copy_of(source, tmp_path).glob("*.safetensors"))
    config = {**EVERY_LAYER, "cpu_memory_gb": 0}
    model, offloader = load_model(tmp_path, config)  # just written: in the page cache
    assert offloader.stats().disk.io == "mmap"
    offloader.close()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    model, offloader = load_model(tmp_path, config)
    assert offloader.stats().disk.io == "direct"
    assert torch.equal(zoo.logits(model, zoo.inputs()), zoo.logits(resident, zoo.inputs()))
    offloader.close()


def test_files_that_cannot_be_leased_are_read_or_refused(aligned, tmp_path):
    """A file held open for writing cannot be leased: "auto" reads it through the page
    cache (same logits); an explicit "mmap" is one error saying why."""
    source, resident = aligned
    files = sorted(_copy_of(source, tmp_path).glob("*.safetensors"))
    writer = os.open(files[-1], os.O_WRONLY)
    try:
        model, offloader = load_model(tmp_path, {**EVERY_LAYER, "cpu_memory_gb": 0})
        assert offloader.stats().disk.io == "page-cache"
        assert torch.equal(zoo.logits(model, zoo.inputs()), zoo.logits(resident, zoo.inputs()))
        offloader.close()
        with pytest.raises(ModelError, match=r"disk_io='mmap': cannot hold a read lease on"):
            load_model(tmp_path, {**EVERY_LAYER, "cpu_memory_gb": 0, "disk_io": "mmap"})
    finally:
        os.close(writer)


@pytest.mark.parametrize("io", ["direct", "page-cache", "mmap"])
def test_a_failure_halfway_through_gives_back_the_layers_on_disk_too(tmp_path, monkeypatch, io):
    """The second layer's host slab cannot be made after the layers beyond the host budget
    were left in their file: `apply` gives every parameter back, those read back from the
    checkpoint included (they were left on the meta device, and a mapped tier's reader
    refused to read them back)."""
    import offload
    import offload.memory.host as host

    model = zoo.build("llama", num_layers=4)
    model.save_pretrained(tmp_path)
    zoo.realign(tmp_path)  # (mapped too)
    expected = zoo.logits(model, zoo.inputs())
    real, made = host.HostSlab, []

    def failing(*args, **kwargs):
        made.append(1)
        if len(made) == 2:
            raise MemoryError("no host memory left")
        return real(*args, **kwargs)

    layer_bytes = zoo.layer_param_bytes(model) // 4
    budget = 2.5 * layer_bytes / 2**30  # two layers in host memory, two on disk
    config = {**EVERY_LAYER, "cpu_memory_gb": budget, "disk_io": io}
    monkeypatch.setattr("offload.offloader.ledger.HostSlab", failing)
    with pytest.raises(MemoryError):
        offload.apply(model, config, checkpoint=tmp_path)
    monkeypatch.undo()
    assert not any(p.is_meta for p in model.parameters())
    assert torch.equal(zoo.logits(model, zoo.inputs()), expected)
    offloader = offload.apply(model, config, checkpoint=tmp_path)  # and after all, it can be
    assert offloader.stats().disk.num_units == 2
    assert torch.equal(zoo.logits(model, zoo.inputs()), expected)
    offloader.close()
