"""UVA backend on the CPU: exactness on many architectures, accounting, fallback, ties."""

import warnings

import pytest
import torch
import zoo
from torch import nn

import offload
from offload import OffloadConfig, UVAOffloader, create_offloader, get_offloader
from offload.offloader.layers import find_layers

SETTINGS = {
    "half-budget": lambda model: {"cpu_offload_gb": zoo.layer_param_bytes(model) / 2 / 1024**3},
    "all-layers": lambda model: {"cpu_offload_gb": zoo.layer_param_bytes(model) / 1024**3},
    "weights-only": lambda model: {"cpu_offload_gb": 1e-3, "cpu_offload_params": ["weight"]},
    "copy-per-forward": lambda model: {"cpu_offload_gb": 1e-3, "disable_uva": True},
    "tiny-budget": lambda model: {"cpu_offload_gb": 1e-9},
}


def _in_slab(tensor: torch.Tensor, offloader: UVAOffloader) -> bool:
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    return any(
        slab.buffer.data_ptr() <= start and end <= slab.buffer.data_ptr() + slab.num_bytes
        for slab in offloader.slabs
    )


def assert_really_offloaded(model: nn.Module, offloader: UVAOffloader) -> None:
    """Every manifest entry is a real parameter whose bytes now live in a host slab;
    no other parameter does."""
    params = dict(model.named_parameters())
    listed = {entry.name for entry in offloader.manifest()}
    assert listed, "nothing was offloaded"
    for entry in offloader.manifest():
        param = params[entry.name]
        assert entry.num_bytes == param.numel() * param.element_size()
        assert entry.shape == tuple(param.shape) and entry.dtype == param.dtype
        assert _in_slab(param, offloader), entry.name  # outside a forward, always the slab
    for name, param in params.items():
        if name not in listed:
            assert not _in_slab(param, offloader), name
    assert offloader.offloaded_bytes == sum(e.num_bytes for e in offloader.manifest())


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("arch", zoo.ARCHS)
def test_logits_bitwise_equal(arch, setting):
    model = zoo.build(arch)
    ids = zoo.inputs()
    expected = zoo.logits(model, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a budget above the model warns; tested below
        offloader = offload.apply(model, SETTINGS[setting](model))
    assert get_offloader() is offloader
    assert_really_offloaded(model, offloader)
    assert torch.equal(zoo.logits(model, ids), expected)
    assert torch.equal(zoo.logits(model, ids), expected)  # and again: nothing drifted


@pytest.mark.parametrize("setting", ["all-layers", "copy-per-forward"])
@pytest.mark.parametrize("arch", zoo.CAUSAL_ARCHS)
def test_greedy_tokens_equal(arch, setting):
    model = zoo.build(arch)
    ids = zoo.inputs()
    expected = zoo.greedy(model, ids)
    offload.apply(model, SETTINGS[setting](model))
    assert torch.equal(zoo.greedy(model, ids), expected)


def test_budget_is_filled_in_module_order_per_parameter():
    model = zoo.build("llama")
    order = [(name, p.numel() * 4) for name, p in model.named_parameters() if ".layers." in name]
    budget = sum(size for _, size in order[:5]) - 1  # stops inside layer 0, after 5 params
    offloader = offload.apply(model, {"cpu_offload_gb": budget / 1024**3})
    assert [e.name for e in offloader.manifest()] == [name for name, _ in order[:5]]
    assert offloader.offloaded_bytes == sum(size for _, size in order[:5])
    assert {e.module for e in offloader.manifest()} == {"model.layers.0"}


def test_selected_params_only_and_budget_still_applies():
    model = zoo.build("llama")
    one_mlp = sum(p.numel() * 4 for p in model.model.layers[0].mlp.parameters())
    offloader = offload.apply(
        model, {"cpu_offload_gb": one_mlp * 1.5 / 1024**3, "cpu_offload_params": ["mlp"]}
    )
    names = [e.name for e in offloader.manifest()]
    assert names and all(".mlp." in name for name in names)
    assert {e.module for e in offloader.manifest()} == {"model.layers.0", "model.layers.1"}
    assert offloader.offloaded_bytes >= one_mlp * 1.5


def test_copy_per_forward_moves_the_offloaded_bytes_each_forward():
    model = zoo.build("qwen2")
    ids = zoo.inputs()
    expected = zoo.logits(model, ids)
    offloader = offload.apply(model, {"cpu_offload_gb": 1, "disable_uva": True})
    assert {e.access for e in offloader.manifest()} == {"copy-per-forward"}
    before = [p.data_ptr() for p in model.parameters()]
    for step in range(1, 3):
        assert torch.equal(zoo.logits(model, ids), expected)
        assert offloader.stats().bytes_copied == step * offloader.offloaded_bytes
    # The host copies are back in place after each forward.
    assert [p.data_ptr() for p in model.parameters()] == before


def test_env_var_disables_uva(monkeypatch):
    monkeypatch.setenv("VLLM_WEIGHT_OFFLOADING_DISABLE_UVA", "1")
    model = zoo.build("llama")
    offloader = offload.apply(model, {"cpu_offload_gb": 1e-3})
    assert {e.access for e in offloader.manifest()} == {"copy-per-forward"}


def test_copy_per_forward_restores_after_an_exception():
    model = zoo.build("llama")
    offloader = offload.apply(model, {"cpu_offload_gb": 1, "disable_uva": True})
    layer = model.model.layers[0]
    before = [p.data_ptr() for p in layer.parameters()]
    with pytest.raises(TypeError):
        layer()  # missing arguments: the forward raises after the copies are in
    assert [p.data_ptr() for p in layer.parameters()] == before
    assert offloader.stats().bytes_copied > 0


class TiedStack(nn.Module):
    """Layer 0 and layer 2 share one Linear; the embedding is tied to layer 1's weight."""

    def __init__(self):
        super().__init__()
        shared = nn.Linear(16, 16)
        self.layers = nn.ModuleList(
            [
                nn.Sequential(shared, nn.Tanh()),
                nn.Sequential(nn.Linear(16, 16), nn.Tanh()),
                nn.Sequential(shared, nn.Tanh()),
            ]
        )
        self.embed = nn.Embedding(16, 16)
        self.embed.weight = self.layers[1][0].weight

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return h @ self.embed.weight.T


@pytest.mark.parametrize("disable_uva", [False, True])
def test_tied_weights(disable_uva):
    torch.manual_seed(0)
    model = TiedStack()
    ids = torch.arange(16).reshape(2, 8)
    expected = model(ids)
    offloader = offload.apply(model, {"cpu_offload_gb": 1, "disable_uva": disable_uva})
    names = [e.name for e in offloader.manifest()]
    # The shared Linear is offloaded once; the weight tied to the embedding stays resident.
    assert names == ["layers.0.0.weight", "layers.0.0.bias", "layers.1.0.bias"]
    assert model.layers[0][0] is model.layers[2][0]
    assert model.embed.weight is model.layers[1][0].weight
    assert torch.equal(model(ids), expected)


def test_budget_larger_than_model_warns_and_offloads_everything():
    model = zoo.build("gpt2")
    with pytest.warns(UserWarning, match="more than the .* GiB of offloadable parameters"):
        offloader = offload.apply(model, {"cpu_offload_gb": 10})
    assert offloader.offloaded_bytes == zoo.layer_param_bytes(model)


def test_segments_matching_nothing_is_an_error_and_changes_nothing():
    model = zoo.build("llama")
    before = {name: p.data_ptr() for name, p in model.named_parameters()}
    with pytest.raises(offload.ModelError, match=r"match no parameter.*e\.g\. 'self_attn"):
        offload.apply(model, {"cpu_offload_gb": 1, "cpu_offload_params": ["experts"]})
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == before


def test_some_segments_matching_nothing_warns():
    model = zoo.build("llama")
    with pytest.warns(UserWarning, match=r"\['experts'\] match no parameter"):
        offloader = offload.apply(
            model, {"cpu_offload_gb": 1, "cpu_offload_params": ["experts", "mlp"]}
        )
    assert offloader.manifest()


def test_host_memory_is_offloaded_bytes_plus_alignment():
    model = zoo.build("llama")
    offloader = offload.apply(model, {"cpu_offload_gb": 1})
    num_params = len(offloader.manifest())
    slack = num_params * 256 + len(offloader.slabs) * 4096  # alignment and page rounding
    assert offloader.offloaded_bytes <= offloader.host_bytes <= offloader.offloaded_bytes + slack
    assert offloader.pinned_bytes == 0  # no GPU here: nothing to pin for


def test_vllm_style_use_without_apply():
    """Code written against vLLM: create_offloader + wrap_modules(generator) + post_init."""
    model = zoo.build("mistral")
    ids = zoo.inputs()
    expected = zoo.logits(model, ids)
    offloader = create_offloader(OffloadConfig(uva={"cpu_offload_gb": 1e-3}))
    assert isinstance(offloader, UVAOffloader)
    layers = offloader.wrap_modules(layer for layer in model.model.layers)
    offloader.post_init()
    offloader.sync_prev_onload()
    offloader.join_after_forward()
    assert layers == list(model.model.layers)
    assert offloader.manifest()[0].name.startswith("wrapped.0.")
    assert torch.equal(zoo.logits(model, ids), expected)


def test_noop_offloader_when_nothing_is_configured():
    model = zoo.build("llama")
    offloader = offload.apply(model, None)
    assert isinstance(offloader, offload.NoopOffloader)
    assert offloader.offloaded_bytes == 0 and offloader.manifest() == []


def test_layers_can_be_given_explicitly():
    model = zoo.build("llama")
    offloader = offload.apply(model, {"cpu_offload_gb": 1}, layers=[model.model.layers[2]])
    assert {e.module for e in offloader.manifest()} == {"model.layers.2"}
    offloader = offload.apply(zoo.build("llama"), {"cpu_offload_gb": 1}, layers="model.layers")
    assert len({e.module for e in offloader.manifest()}) == len(find_layers(model))


@pytest.mark.parametrize("disable_uva", [False, True])
def test_parameters_replaced_after_offloading_are_no_longer_counted(disable_uva):
    """`module.to(dtype)` after offloading makes new, resident parameters: the figures
    stop counting them (with one warning), instead of reporting bytes that moved back."""
    model = zoo.build("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the budget is more than the model)
        offloader = offload.apply(model, {"cpu_offload_gb": 1, "disable_uva": disable_uva})
    before = offloader.stats()
    assert before.offloaded_bytes > 0
    model.model.layers[0].to(torch.float64).to(torch.float32)  # new tensors, resident
    moved = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    with pytest.warns(UserWarning, match="no longer live in host memory"):
        after = offloader.stats()
    assert after.offloaded_bytes == before.offloaded_bytes - moved
    assert offloader.offloaded_bytes == after.offloaded_bytes
    layer_params = len(list(model.model.layers[0].parameters()))
    assert after.num_offloaded_params == before.num_offloaded_params - layer_params
    model(torch.randint(0, 100, (1, 4)))  # copy-per-forward hooks still restore cleanly
    assert offloader.stats().offloaded_bytes == after.offloaded_bytes
