"""Bad input to offload.apply: one clear error, nothing changed."""

import dataclasses

import pytest
import torch
import zoo
from torch import nn

import offload
from offload.api import finish, plan, prepare


def _params(model):
    return {name: (p.device, p.data_ptr()) for name, p in model.named_parameters()}


def test_meta_model_is_refused():
    config, auto = zoo._configs()["llama"]
    with torch.device("meta"):
        model = auto.from_config(config)
    with pytest.raises(offload.ModelError) as info:
        offload.apply(model, {"cpu_offload_gb": 1})
    message = str(info.value)
    assert "on the meta device (first: 'model.embed_tokens.weight')" in message
    assert "\n" not in message


def test_model_without_a_stack_is_refused_and_untouched():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    before = _params(model)
    with pytest.raises(offload.ModelError, match="found no repeated layer stack"):
        offload.apply(model, {"cpu_offload_gb": 1})
    assert _params(model) == before


@pytest.mark.parametrize(
    ("config", "error"),
    [
        ({"cpu_offload_gb": -1}, offload.ConfigError),
        ({"offload_backend": "gpu"}, offload.ConfigError),
        ({"cpu_offload_gbs": 1}, offload.ConfigError),
        ("cpu_offload_gb=1", offload.ConfigError),
    ],
)
def test_bad_config_is_refused_and_model_untouched(config, error):
    model = zoo.build("llama")
    before = _params(model)
    with pytest.raises(error):
        offload.apply(model, config)
    assert _params(model) == before


def test_not_a_module():
    with pytest.raises(offload.ModelError, match=r"needs a torch\.nn\.Module"):
        offload.apply("llama", {"cpu_offload_gb": 1})


def test_a_config_object_cannot_change_after_it_is_checked():
    config = offload.OffloadConfig(uva={"cpu_offload_gb": 1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.uva.cpu_offload_gb = -5
    with pytest.raises(offload.ConfigError, match="cpu_offload_gb"):
        offload.apply(zoo.build("llama"), {"uva": {"cpu_offload_gb": -5}})


def test_offloaded_model_reports_params_on_the_compute_device():
    model = zoo.build("llama")
    offload.apply(model, {"cpu_offload_gb": 1}, device="cpu")
    assert {p.device for p in model.parameters()} == {torch.device("cpu")}


PREFETCH = {"offload_group_size": 1, "offload_prefetch_step": 1}
UVA = {"cpu_offload_gb": 1}


def _logits(model, x):
    with torch.no_grad():
        return model(x).logits


@pytest.mark.parametrize("first", [PREFETCH, UVA])
@pytest.mark.parametrize("second", [PREFETCH, UVA])
def test_offloading_twice_is_refused_and_the_model_still_works(first, second):
    model = zoo.build("llama")
    x = torch.randint(0, 100, (1, 6))
    expected = _logits(model, x)
    offload.apply(model, first)
    with pytest.raises(offload.ModelError, match="already offloaded"):
        offload.apply(model, second)
    assert torch.equal(_logits(model, x), expected)


@pytest.mark.parametrize("device", ["meta", "nonsense", "cuda:99"])
def test_an_unusable_device_is_refused_before_anything_changes(device):
    model = zoo.build("llama")
    before = _params(model)
    with pytest.raises(offload.ConfigError, match="device"):
        offload.apply(model, PREFETCH, device=device)
    assert _params(model) == before


@pytest.mark.parametrize("config", [PREFETCH, UVA])
def test_a_failure_halfway_through_is_undone(config, monkeypatch):
    """The third layer's host slab cannot be made: the first two are given back."""
    import offload.memory.host as host

    model = zoo.build("llama", num_layers=4)
    x = torch.randint(0, 100, (1, 6))
    expected = _logits(model, x)
    real = host.HostSlab
    made = []

    def failing(*args, **kwargs):
        made.append(1)
        if len(made) == 3:
            raise MemoryError("no host memory left")
        return real(*args, **kwargs)

    monkeypatch.setattr("offload.offloader.ledger.HostSlab", failing)  # both backends' slabs
    with pytest.raises(MemoryError):
        offload.apply(model, config)
    assert len(made) == 3
    monkeypatch.undo()
    assert torch.equal(_logits(model, x), expected)
    offloader = offload.apply(model, config)  # and it can be offloaded after all
    assert offloader.offloaded_bytes > 0
    assert torch.equal(_logits(model, x), expected)


class _SharedHead(nn.Module):
    """A block's submodule that the model also uses outside the stack."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.head = self.blocks[1][0]

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("config", [PREFETCH, UVA])
def test_a_submodule_also_used_outside_the_stack_stays_resident(config):
    torch.manual_seed(0)
    model = _SharedHead()
    x = torch.randn(2, 8)
    expected = model(x)
    offloader = offload.apply(model, config)
    names = {entry.name for entry in offloader.manifest()}
    assert names and not any(name.startswith("blocks.1.") for name in names)
    assert torch.equal(model(x), expected)


@pytest.mark.parametrize("gpu", [True, False])
def test_offloading_to_the_cpu_it_computes_on_warns_only_when_a_gpu_is_usable(gpu, monkeypatch):
    import warnings

    monkeypatch.setattr(offload.api, "cuda_usable", lambda: gpu)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        offload.apply(zoo.build("llama"), {"offload_group_size": 1, "offload_num_in_group": 1})
        offload.apply(zoo.build("llama"), None)  # nothing offloaded: nothing to say
    said = [str(w.message) for w in caught if "a GPU is usable" in str(w.message)]
    assert len(said) == (1 if gpu else 0)
    assert all("device='cuda'" in message for message in said)


@pytest.mark.parametrize("config", [None, PREFETCH, UVA])
def test_a_plan_is_carried_out_by_its_own_offloader(config):
    """`prepare(planned=...)` wraps the model with the offloader the dry run made (no
    second one), moving what the plan said; only on that model, and only once."""
    model = zoo.build("llama")
    x = torch.randint(0, 100, (1, 6))
    expected = _logits(model, x)
    planned = plan(model, config, torch.device("cpu"))
    with pytest.raises(offload.ModelError, match="the model it was made for"):
        prepare(zoo.build("llama"), config, torch.device("cpu"), planned=planned)
    offloader = finish(prepare(model, config, torch.device("cpu"), planned=planned))
    assert offloader is planned.offloader
    assert offloader.manifest() == planned.params and torch.equal(_logits(model, x), expected)
    if config is not None:
        with pytest.raises(offload.ModelError, match="already offloaded"):
            prepare(model, config, torch.device("cpu"), planned=planned)
