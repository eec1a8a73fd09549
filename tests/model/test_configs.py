import pytest

from offload.cli import main
from offload.model.build import build_empty
from offload.model.configs import resolve, shipped
from offload.model.loader import load_model

# Parameter counts published for these models.
PUBLISHED = {
    "llama-3-8b": 8.03e9,
    "llama-3-70b": 70.6e9,
    "llama-3.2-1b": 1.24e9,
    "qwen2.5-7b": 7.62e9,
    "mistral-7b": 7.24e9,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shipped_shapes_have_the_published_sizes(name):
    model = build_empty(resolve(name), "auto")
    count = sum(p.numel() for p in model.parameters())
    assert abs(count - PUBLISHED[name]) / PUBLISHED[name] < 0.01
    assert all(p.is_meta for p in model.parameters())  # nothing allocated


def test_every_shipped_config_is_listed():
    assert shipped() == sorted(PUBLISHED)


def test_inspect_by_name(capsys):
    assert main(["inspect", "llama-3-8b", "--cpu-offload-gb", "8"]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM, 15.0 GiB" in out and "model.layers: 32 x LlamaDecoderLayer" in out
    assert "uva would offload 8.0 GiB" in out


def test_names_resolve_only_for_dummy_loads(tmp_path):
    from offload import ModelError

    with pytest.raises(ModelError, match="does not exist"):
        load_model("llama-3-8b")  # a real load needs a real folder
