import pytest
import torch
import zoo
from torch import nn

from offload import ModelError
from offload.offloader.layers import find_layer_stacks, find_layers, resolve_layers

EXPECTED_STACKS = {
    "llama": ["model.layers"],
    "qwen2": ["model.layers"],
    "qwen3_moe": ["model.layers"],
    "gpt2": ["transformer.h"],
    "gpt_neox": ["gpt_neox.layers"],
    "opt": ["model.decoder.layers"],
    "bert": ["bert.encoder.layer"],
    "t5": ["encoder.block", "decoder.block"],
}


@pytest.mark.parametrize("arch", list(EXPECTED_STACKS))
def test_finds_the_transformers_layer_stacks(arch):
    model = zoo.build(arch)
    stacks = find_layer_stacks(model)
    assert [name for name, _ in stacks] == EXPECTED_STACKS[arch]
    blocks = find_layers(model)
    assert blocks == [b for name in EXPECTED_STACKS[arch] for b in model.get_submodule(name)]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])  # nested stack
        self.norm = nn.LayerNorm(4)


class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))  # not a stack
        self.blocks = nn.Sequential(Block(), Block())


def test_custom_model_nested_stacks_belong_to_their_block():
    model = Custom()
    assert [name for name, _ in find_layer_stacks(model)] == ["blocks"]


def test_no_stack_is_a_clear_error():
    with pytest.raises(
        ModelError, match=r"found no repeated layer stack in Sequential.*pass layers="
    ):
        find_layers(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))


def test_resolve_layers_forms():
    model = zoo.build("llama")
    blocks = list(model.model.layers)
    assert resolve_layers(model, "model.layers") == blocks
    assert resolve_layers(model, model.model.layers) == blocks
    assert resolve_layers(model, model.model.layers[1]) == [blocks[1]]
    assert resolve_layers(model, iter(blocks[:2])) == blocks[:2]


@pytest.mark.parametrize(
    ("layers", "needle"),
    [
        ("model.blocks", "names no submodule"),
        ([nn.Linear(2, 2)], "must be submodules of the model"),
        ([], "is empty"),
    ],
)
def test_resolve_layers_errors(layers, needle):
    with pytest.raises(ModelError, match=needle):
        resolve_layers(zoo.build("llama"), layers)


def test_layers_with_no_parameters_are_not_a_stack():
    model = nn.Module()
    model.acts = nn.ModuleList([nn.ReLU(), nn.ReLU()])
    model.proj = nn.Linear(2, 2)
    assert find_layer_stacks(model) == []
    assert torch.is_tensor(model.proj.weight)


class Stem(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 4)

    def forward(self, x):
        return self.proj(x).relu()


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.mix = nn.Linear(4, 4)

    def forward(self, x):
        return x + self.mix(self.norm(x))


def test_the_blocks_between_a_stem_and_a_head_of_a_sequential_are_a_stack():
    model = nn.Sequential(Stem(), Block(), Block(), Block(), nn.Linear(4, 4), nn.Linear(4, 2))
    assert [name for name, _ in find_layer_stacks(model)] == ["[1:4]"]
    assert find_layers(model) == list(model)[1:4]
    # Consecutive children of one type but different shapes are not repeated blocks.
    mlp = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 8), nn.Linear(8, 4))
    assert find_layer_stacks(mlp) == []


def test_apply_offloads_a_sequential_with_a_stem_and_a_head():
    import offload

    torch.manual_seed(0)
    model = nn.Sequential(Stem(), *[Residual() for _ in range(4)], nn.Linear(4, 2))
    x = torch.randn(2, 3)
    with torch.no_grad():
        expected = model(x)
        offloader = offload.apply(model, {"offload_group_size": 1, "offload_num_in_group": 1})
        assert offloader.offloaded_bytes == sum(
            p.numel() * p.element_size() for b in list(model)[1:5] for p in b.parameters()
        )
        assert torch.equal(model(x), expected)
    assert offloader.stats().bytes_copied > 0
