"""`ModelSpec`: the model preamble, run once."""

from pathlib import Path

import pytest
import torch

from offload.errors import ConfigError
from offload.llm.spec import model_spec
from offload.model.spec import ModelSpec


def test_a_spec_holds_the_resolved_folder_and_the_model_on_meta(smollm2_path):
    spec = model_spec(None, device="cpu", dtype="float32")
    assert isinstance(spec, ModelSpec) and spec.device == torch.device("cpu")
    assert spec.path == Path(smollm2_path) or spec.path.is_dir()
    assert all(p.is_meta for p in spec.empty.parameters())
    with pytest.raises(AttributeError):
        spec.path = Path(".")  # frozen


def test_a_shipped_shape_is_a_spec_only_where_shapes_are_asked_for():
    spec = model_spec("llama-3.2-1b", device="cpu", shapes=True)
    assert spec.path.name == "llama-3.2-1b"
    assert type(spec.empty).__name__ == "LlamaForCausalLM"


def test_the_quantization_is_checked_before_the_model_is_read(monkeypatch):
    import offload.model.spec as spec_module

    monkeypatch.setattr(spec_module, "resolve_model", lambda *a, **k: pytest.fail("resolved"))
    with pytest.raises(ConfigError, match="--quantization must be None or one of"):
        model_spec(None, device="cpu", quantization="zip", quantization_name="--quantization")
