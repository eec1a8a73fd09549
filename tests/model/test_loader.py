"""The low-memory loader: exact weights into their tiers, sharded checkpoints, dtypes,
dummy weights, clear errors, and peak memory measured in a fresh process."""

import json
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import zoo
from transformers import AutoModelForCausalLM

from offload import ModelError
from offload.demo import load_pretrained as hf_load
from offload.memory.disk import CheckpointError
from offload.model.loader import load_model

QUESTION = "What is the capital of France?"
SETTINGS = {
    "resident": None,
    "uva-partial": {"cpu_offload_gb": 0.2},
    "uva-copy-per-forward": {"cpu_offload_gb": 0.1, "disable_uva": True},
    "prefetch-all": {"offload_group_size": 1, "offload_prefetch_step": 2},
}


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_path):
    model, tokenizer = hf_load(smollm2_path)
    ids = tokenizer(QUESTION, return_tensors="pt").input_ids
    with torch.no_grad():
        return ids, model(ids).logits


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_smollm2_loads_bitwise_equal_to_transformers(smollm2_path, smollm2_reference, setting):
    ids, logits = smollm2_reference
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, offloader = load_model(smollm2_path, SETTINGS[setting])
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert not any(p.is_meta for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)
    if SETTINGS[setting]:
        assert offloader.offloaded_bytes > 0
        entry = offloader.manifest()[0]
        assert offloader.host_view(model.get_parameter(entry.name)) is not None


@pytest.fixture
def tiny_checkpoint(tmp_path):
    model = zoo.build("llama", num_layers=4)
    model.save_pretrained(tmp_path / "tiny")
    return model, tmp_path / "tiny"


def test_sharded_checkpoint(tmp_path):
    model = zoo.build("qwen2", num_layers=4)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="60KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ids = zoo.inputs()
    loaded, offloader = load_model(
        tmp_path / "sharded", {"offload_group_size": 2, "offload_prefetch_step": 1}
    )
    assert torch.equal(zoo.logits(loaded, ids), zoo.logits(model, ids))
    assert offloader.stats()["num_offloaded_layers"] == 2


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", torch.bfloat16])
def test_dtype_cast_matches_transformers(tiny_checkpoint, dtype):
    _, path = tiny_checkpoint
    expected = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    loaded, _ = load_model(path, {"cpu_offload_gb": 1e-4}, dtype=dtype)
    assert {p.dtype for p in loaded.parameters()} == {expected.dtype}
    ids = zoo.inputs()
    assert torch.equal(zoo.logits(loaded, ids), zoo.logits(expected, ids))


def test_dummy_weights_need_only_the_config(tiny_checkpoint, tmp_path):
    _, path = tiny_checkpoint
    only_config = tmp_path / "config-only"
    only_config.mkdir()
    shutil.copy(path / "config.json", only_config / "config.json")
    first, _ = load_model(only_config, {"offload_group_size": 2}, load_format="dummy")
    second, _ = load_model(only_config, None, load_format="dummy")
    assert torch.equal(zoo.logits(first, zoo.inputs()), zoo.logits(second, zoo.inputs()))
    weight = second.model.layers[0].mlp.up_proj.weight
    assert 0.015 < weight.std().item() < 0.025


def _corrupt(path):
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")


def _truncate(path):
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) - 1000])


def _unknown_architecture(path):
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "no-such-model"
    (path / "config.json").write_text(json.dumps(config))


def _wrong_shape(path):
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 80
    (path / "config.json").write_text(json.dumps(config))


def _no_weights(path):
    (path / "model.safetensors").unlink()


@pytest.mark.parametrize(
    ("damage", "error", "needle"),
    [
        (_corrupt, CheckpointError, "is not a valid safetensors file"),
        (_truncate, CheckpointError, "is truncated"),
        (_unknown_architecture, ModelError, "unknown or unsupported architecture"),
        (_wrong_shape, ModelError, "checkpoint shape"),
        (_no_weights, CheckpointError, "has no model.safetensors"),
    ],
)
def test_bad_checkpoints_fail_before_anything_is_allocated(tiny_checkpoint, damage, error, needle):
    _, path = tiny_checkpoint
    damage(path)
    with pytest.raises(error) as info:
        load_model(path, {"cpu_offload_gb": 1})
    assert needle in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("make_path", "needle"),
    [
        (lambda tmp: tmp / "absent", "does not exist"),
        (lambda tmp: tmp, "is not a model directory"),
    ],
)
def test_bad_paths(tmp_path, make_path, needle):
    with pytest.raises(ModelError, match=needle):
        load_model(make_path(tmp_path))


def test_bad_options(tiny_checkpoint):
    _, path = tiny_checkpoint
    with pytest.raises(ModelError, match="load_format must be one of auto, safetensors, dummy"):
        load_model(path, load_format="pt")
    with pytest.raises(ModelError, match="dtype must be auto, float32, bfloat16, float16"):
        load_model(path, dtype="int8")


PEAK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from offload.model.loader import build_empty, load_model
    from offload.model.layers import find_layers

    path, config = sys.argv[1], json.loads(sys.argv[2])
    def status(field):  # this process's own accounting, in bytes
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    build_empty(Path(path), "auto")  # imports the model's code first: not part of loading
    # Reset the peak to the current RSS (ru_maxrss would still hold the parent's, from before exec).
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    before = status("VmRSS")
    model, offloader = load_model(path, config)
    after = status("VmHWM")
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(sum(p.numel() * p.element_size() for p in l.parameters()) for l in find_layers(model))
    print(json.dumps({"growth": after - before, "total": total, "largest": largest,
                      "offloaded": offloader.offloaded_bytes}))
    """
)


@pytest.mark.parametrize("config", [{"offload_group_size": 1}, {"cpu_offload_gb": 0.2}, None])
def test_peak_host_memory_is_one_copy_of_the_weights(tmp_path, config):
    """A fresh process loads a ~400 MB checkpoint: its peak RSS grows by no more than the
    weights themselves (all in host memory here: the CPU is the device) plus one layer
    and a little slack, never by a second copy of the model."""
    from transformers import LlamaConfig

    shape = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
                        num_key_value_heads=8, vocab_size=16000, tie_word_embeddings=False)  # fmt: skip
    AutoModelForCausalLM.from_config(shape).save_pretrained(tmp_path / "big")
    result = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(tmp_path / "big"), json.dumps(config)],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["total"] > 350e6
    assert figures["growth"] <= figures["total"] + figures["largest"] + 64 * 2**20, figures
