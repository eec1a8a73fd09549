"""A damaged float checkpoint (nan or inf in a plain tensor) is named when its logits
come out non-finite: the file's tensor, not a guess between the file and the dtype."""

from __future__ import annotations

import pytest
import torch
import zoo
from safetensors.torch import load_file, save_file

from offload import LLM, SamplingParams
from offload.errors import ModelError
from offload.model.finite_checks import non_finite_tensor

GREEDY = SamplingParams(temperature=0, max_tokens=2)


def _damage(path, name: str, value: float) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    tensors[name][3, :5] = value
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_logits_name_the_damaged_tensor(tmp_path, value):
    path = zoo.save_with_tokenizer(zoo.build("llama"), tmp_path)
    name = "model.layers.1.mlp.up_proj.weight"
    _damage(path, name, value)
    damaged = pytest.raises(ModelError, match=rf"tensor '{name}' in model.safetensors holds 5 ")
    with LLM(str(path), dtype="float32") as llm, damaged:
        llm.generate(["t5 t6 t7"], GREEDY, use_tqdm=False)


def test_a_finite_checkpoint_leaves_the_guards_message(tmp_path):
    path = zoo.save_with_tokenizer(zoo.build("llama"), tmp_path)
    assert non_finite_tensor(path) is None
    assert non_finite_tensor(tmp_path / "none") is None  # (nothing to read: no answer)
    # A tensor read in blocks of rows: a bad value in a late block is counted.
    save_file({"w": torch.zeros(5000, 4000), "b": torch.ones(3)}, tmp_path / "x.safetensors")
    tensors = load_file(tmp_path / "x.safetensors")
    tensors["w"][4999, -1] = float("-inf")
    save_file(tensors, tmp_path / "x.safetensors")
    assert non_finite_tensor(tmp_path / "x.safetensors") == ("x.safetensors", "w", 1)
