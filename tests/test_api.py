"""Bad input to offload.apply: one clear error, nothing changed."""

import pytest
import torch
import zoo
from torch import nn

import offload


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


def test_config_object_is_revalidated():
    config = offload.OffloadConfig(uva={"cpu_offload_gb": 1})
    config.uva.cpu_offload_gb = -5
    with pytest.raises(offload.ConfigError, match="cpu_offload_gb"):
        offload.apply(zoo.build("llama"), config)


def test_offloaded_model_reports_params_on_the_compute_device():
    model = zoo.build("llama")
    offload.apply(model, {"cpu_offload_gb": 1}, device="cpu")
    assert {p.device for p in model.parameters()} == {torch.device("cpu")}
