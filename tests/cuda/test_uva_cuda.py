"""UVA on a real GPU: zero-copy views, exactness, and device memory. Skipped without CUDA."""

import pytest
import torch
import zoo

import offload
from offload.memory.host import HostSlab, TensorSpec, device_view

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")
MIB = 2**20


def _resident_bytes(model, offloader):
    params = [p for p in model.parameters() if not offloader.ledger.is_offloaded(p)]
    return sum(t.numel() * t.element_size() for t in (*params, *model.buffers()))


def test_device_view_reads_and_writes_host_memory_in_place():
    slab = HostSlab([TensorSpec((MIB,), torch.float32)], pin_for=CUDA)
    assert slab.is_pinned
    host = slab.views[0]
    host.fill_(1.0)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    view = device_view(host, CUDA)
    assert torch.cuda.memory_allocated() == before  # no device memory behind the view
    assert view.device.type == "cuda" and view.data_ptr() == host.data_ptr()
    assert view.sum().item() == MIB
    host.fill_(2.0)  # the GPU sees a change made on the host...
    assert view.sum().item() == 2 * MIB
    view.mul_(3.0)  # ...and the host sees a change made by a kernel
    torch.cuda.synchronize()
    assert host[0].item() == 6.0 and host[-1].item() == 6.0


@pytest.mark.parametrize("disable_uva", [False, True])
def test_smollm2_offloaded_from_cpu_is_exact_without_a_device_spike(
    checkpoint, reference, disable_uva
):
    ids, logits, tokens = reference
    model = zoo.load_on_cpu(checkpoint)  # on the CPU
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    offloader = offload.apply(
        model, {"cpu_offload_gb": 0.3955, "disable_uva": disable_uva}, device=CUDA
    )
    resident = _resident_bytes(model, offloader)
    assert torch.cuda.memory_allocated() - base <= resident + MIB
    assert torch.cuda.max_memory_allocated() - base <= resident + MIB  # never the whole model
    assert {e.location for e in offloader.manifest()} == {"host-pinned"}
    access = "copy-per-forward" if disable_uva else "zero-copy"
    assert {e.access for e in offloader.manifest()} == {access}
    assert offloader.pinned_bytes <= 1.02 * offloader.offloaded_bytes
    assert {p.device.type for p in model.parameters()} == (
        {"cuda", "cpu"} if disable_uva else {"cuda"}
    )
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)
    if disable_uva:
        assert offloader.stats().bytes_copied == offloader.offloaded_bytes
    with torch.no_grad():
        new_tokens = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False
        )
    assert torch.equal(new_tokens, tokens)


def test_offloading_a_model_already_on_the_gpu_frees_device_memory(checkpoint, reference):
    ids, logits, _ = reference
    model = zoo.load_on_cpu(checkpoint)
    model.to(CUDA)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    offloader = offload.apply(model, {"cpu_offload_gb": 0.2})
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() <= before + MIB  # layer by layer: no spike
    assert before - torch.cuda.memory_allocated() >= offloader.offloaded_bytes - MIB
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen3_moe", "t5", "bert"])
def test_tiny_architectures_exact_on_gpu(arch):
    model = zoo.build(arch).to(CUDA)
    ids = zoo.inputs().to(CUDA)
    expected = zoo.logits(model, ids)
    offloader = offload.apply(model, {"cpu_offload_gb": zoo.layer_param_bytes(model) / 2 / 1024**3})
    assert offloader.manifest() and offloader.pinned_bytes > 0
    assert torch.equal(zoo.logits(model, ids), expected)
