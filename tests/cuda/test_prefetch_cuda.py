"""Prefetch on a real GPU: copy stream ordering, exactness, memory, CUDA graphs."""

import pytest
import torch
import zoo
from torch import nn

import offload
from offload.memory.copy_engine import CudaCopyEngine

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")
SLEEP_CYCLES = 2_000_000  # ~1 ms of GPU time


class Stack(nn.Module):
    """Layers that may sleep on the GPU before reading their weights."""

    def __init__(self, num_layers=6, width=256, sleep_cycles=0):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(num_layers))
        self.sleep_cycles = sleep_cycles

    def forward(self, x):
        for layer in self.layers:
            if self.sleep_cycles:
                torch.cuda._sleep(self.sleep_cycles)
            x = torch.tanh(layer(x))
        return x


class LateCopies(CudaCopyEngine):
    """Copies start late (a sleep on the copy stream), so an unordered read sees stale bytes."""

    def __init__(self, device, waits=True, orders_release=True):
        super().__init__(device)
        self._waits, self._orders_release = waits, orders_release

    def copy(self, dst, src, after=None):
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(SLEEP_CYCLES)
        return super().copy(dst, src, after if self._orders_release else None)

    def wait(self, ticket):
        if self._waits:
            super().wait(ticket)


def _apply(model, step, engine=None):
    config = {"offload_group_size": 1, "offload_prefetch_step": step}
    factory = (lambda device: engine) if engine is not None else None
    offloader = offload.create_offloader(config, copy_engine_factory=factory)
    offloader.wrap_modules(model.layers)
    offloader.post_init()
    return offloader


@pytest.mark.parametrize("step", [1, 2, 4])
def test_late_copies_still_exact(step):
    model = Stack().to(CUDA)
    x = torch.randn(8, 256, device=CUDA)
    expected = model(x)
    _apply(model, step, LateCopies(CUDA))
    for _ in range(3):
        assert torch.equal(model(x), expected)


def test_missing_wait_is_caught_by_the_late_copy_check():
    model = Stack().to(CUDA)
    x = torch.randn(8, 256, device=CUDA)
    expected = model(x)
    _apply(model, 2, LateCopies(CUDA, waits=False))
    assert not torch.equal(model(x), expected)


def test_copy_waits_for_the_slot_to_be_released():
    """Slow layers and fast copies: without the release wait a copy overwrites a slot
    that a sleeping layer is about to read."""
    model = Stack(sleep_cycles=SLEEP_CYCLES).to(CUDA)
    x = torch.randn(8, 256, device=CUDA)
    expected = model(x)
    _apply(model, 1, CudaCopyEngine(CUDA))
    assert torch.equal(model(x), expected)
    broken = Stack(sleep_cycles=SLEEP_CYCLES).to(CUDA)
    engine = CudaCopyEngine(CUDA)
    engine.mark_released = lambda: None  # the copy no longer waits for the layer
    _apply(broken, 1, engine)
    assert not torch.equal(broken(x), expected)


def test_no_host_synchronisation_in_a_forward():
    model = Stack().to(CUDA)
    x = torch.randn(8, 256, device=CUDA)
    _apply(model, 2)
    model(x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            model(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_graph_replays_the_copies():
    model = Stack(num_layers=5).to(CUDA)
    inputs = [torch.randn(8, 256, device=CUDA) for _ in range(4)]
    expected = [model(x) for x in inputs]
    offloader = _apply(model, 2)
    static_in = inputs[0].clone()
    model(static_in)  # warm up eagerly on a side stream, as capture requires
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model(static_in)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with offloader.graph_capture(graph):
        static_out = model(static_in)
    copies = offloader.stats().copies.num_copies
    for x, want in zip(inputs, expected, strict=True):
        static_in.copy_(x)
        with offloader.graph_capture():
            graph.replay()
        assert torch.equal(static_out, want)
    assert offloader.stats().copies.num_copies == copies  # replays do not go through Python


def test_smollm2_prefetch_exact_with_bounded_device_memory(checkpoint, reference):
    ids, logits, tokens = reference
    model = zoo.load_on_cpu(checkpoint)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    offloader = offload.apply(
        model, {"offload_group_size": 1, "offload_prefetch_step": 2}, device=CUDA
    )
    stats = offloader.stats()
    resident = sum(
        t.numel() * t.element_size()
        for t in (
            *[p for p in model.parameters() if not offloader.ledger.is_offloaded(p)],
            *model.buffers(),
        )
    )
    assert torch.cuda.memory_allocated() - base <= resident + stats.device_staging_bytes + 2**20
    assert stats.device_staging_bytes <= 2 * stats.largest_layer_bytes
    assert stats.pinned_bytes <= 1.02 * stats.offloaded_bytes
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)
    with torch.no_grad():
        new_tokens = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False
        )
    assert torch.equal(new_tokens, tokens)
    stats = offloader.stats()
    assert (
        stats.bytes_copied > 30 * stats.largest_layer_bytes and stats.copies.achieved_gb_per_s > 0
    )


@pytest.mark.parametrize("arch", ["llama", "gpt2", "t5"])
def test_tiny_architectures_prefetch_exact_on_gpu(arch):
    model = zoo.build(arch).to(CUDA)
    ids = zoo.inputs().to(CUDA)
    expected = zoo.logits(model, ids)
    offload.apply(model, {"offload_group_size": 1, "offload_prefetch_step": 2})
    for _ in range(2):
        assert torch.equal(zoo.logits(model, ids), expected)


def _compiled_logits_and_bytes(offloaded: bool):
    """A tiny Llama on the GPU compiled with fullgraph=True, offloaded by prefetch or not:
    its logits (second call) and the bytes copied in over two calls."""
    torch._dynamo.reset()
    model = zoo.build("llama", num_layers=4).to(CUDA)
    ids = zoo.inputs().to(CUDA)
    config = {"offload_group_size": 1, "offload_prefetch_step": 1, "prefetch_unit": "layer"}
    offloader = offload.apply(model, config) if offloaded else None
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        compiled(input_ids=ids)
        logits = compiled(input_ids=ids).logits
    moved = 0
    if offloader is not None:
        offloader.sync_prev_onload()
        moved = offloader.stats().bytes_copied
        offloader.close()
    torch._dynamo.reset()
    return logits, moved


def test_torch_compile_fullgraph_of_prefetch_runs_on_gpu():
    """Inductor and Triton on the GPU: the prefetch hooks and ops (`offload::wait_layer`,
    `start_layer`) trace with fullgraph=True (under torch 2.11 the hooks' id() of a tensor
    did not), the copies move bytes, and the logits are the compiled resident model's to
    float32 rounding (bitwise: the next test)."""
    expected, _ = _compiled_logits_and_bytes(offloaded=False)
    logits, moved = _compiled_logits_and_bytes(offloaded=True)
    assert moved > 0
    assert torch.allclose(logits, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.xfail(
    strict=True,
    reason="measured on an H100 (torch 2.11, 2026-11-27): compiled with prefetch, the logits "
    "differ from the compiled resident model's in the last bits (equal on the CPU); why is "
    "not yet found (a guess: the wait/start ops bound Triton's fusions)",
)
def test_torch_compile_of_prefetch_equals_compiled_resident_bitwise_on_gpu():
    expected, _ = _compiled_logits_and_bytes(offloaded=False)
    logits, _ = _compiled_logits_and_bytes(offloaded=True)
    assert torch.equal(logits, expected)
