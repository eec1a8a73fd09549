"""The low-memory loader: exact weights into their tiers, sharded checkpoints, dtypes,
dummy weights, clear errors, and peak memory measured in a fresh process."""

import json
import shutil
import struct
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import zoo
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from offload import ModelError
from offload.cli.demo import load_pretrained as hf_load
from offload.cli.options import QUESTION
from offload.memory.safetensors import CheckpointError
from offload.model.loader import load_model

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
        assert offloader.ledger.host_view(model.get_parameter(entry.name)) is not None


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
    assert offloader.stats().num_offloaded_layers == 2


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


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("write", "needle"),
    [
        (lambda p: (p / "config.json").write_text("null"), "must hold a JSON object"),
        (lambda p: (p / "config.json").write_text("[1, 2]"), "settings, got array"),
        (lambda p: (p / "config.json").write_text("{oops"), "is not valid JSON"),
        (
            lambda p: _edit_config(p, num_attention_heads=5),
            "invalid llama settings (Class validation error for validator "
            "'validate_architecture': ValueError: The hidden size (64) is not a multiple of "
            "the number of attention heads (5).)",
        ),
        (lambda p: _edit_config(p, hidden_size="abc"), "'hidden_size' expected int, got str"),
        (lambda p: _edit_config(p, hidden_act="nope"), "cannot build the model from these"),
        (
            lambda p: _edit_config(p, num_key_value_heads=3),
            "num_key_value_heads (3) must divide num_attention_heads (4)",
        ),
    ],
    ids=["null", "array", "not-json", "heads", "hidden-size-str", "activation", "kv-heads"],
)
def test_bad_config_contents_are_one_model_error(tiny_checkpoint, write, needle):
    _, path = tiny_checkpoint
    write(path)
    with pytest.raises(ModelError) as info:
        load_model(path)
    message = str(info.value)
    assert message.startswith(f"{path / 'config.json'}") and needle in message, message
    assert "\n" not in message
    assert info.value.__cause__ is None  # no chained traceback under the one line
    assert info.value.__context__ is None or info.value.__suppress_context__


def _safetensors(path, header, data=b""):
    encoded = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def _entry(dtype="F32", shape=(2, 2), offsets=(0, 16)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


NORM = "model.norm.weight"


@pytest.mark.parametrize(
    ("header", "needle"),
    [
        ([1, 2], "is not a valid safetensors file (its header is a JSON array, not an object"),
        (None, "is not a valid safetensors file (its header is a JSON null"),
        ({NORM: "x"}, f"tensor '{NORM}' has a malformed header entry (needs an object"),
        ({NORM: {"shape": [4], "data_offsets": [0, 16]}}, "needs an object with dtype, shape"),
        ({NORM: _entry(dtype="Q4")}, 'has dtype "Q4"; supported: F64, F32'),
        ({NORM: _entry(dtype=7)}, "has dtype 7; supported: F64"),
        ({NORM: _entry(shape=(2, "2"))}, "shape is a list of non-negative integers"),
        ({NORM: _entry(shape=(-1, 2))}, "shape is a list of non-negative integers"),
        ({NORM: _entry(offsets=(-8, 8))}, "has data_offsets [-8, 8]; they must be [begin, end]"),
        ({NORM: _entry(offsets=(16, 0))}, "has data_offsets [16, 0]"),
        ({NORM: _entry(offsets=(0, 16, 32))}, "has data_offsets [0, 16, 32]"),
        ({NORM: _entry(offsets=(0, 12))}, "has 12 bytes, its shape [2, 2] of F32 needs 16"),
        ({NORM: _entry(offsets=(64, 80))}, "is truncated: tensor 'model.norm.weight' ends past"),
    ],
)
def test_malformed_safetensors_headers(tiny_checkpoint, header, needle):
    _, path = tiny_checkpoint
    _safetensors(path, header, data=bytes(16))
    with pytest.raises(CheckpointError) as info:
        load_model(path)
    message = str(info.value)
    assert isinstance(info.value, ModelError)
    assert message.startswith(str(path / "model.safetensors")) and needle in message, message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("index", "needle"),
    [
        ({"weight_map": [1]}, 'is not a valid safetensors index (it must be a JSON object whose "'),
        ({"metadata": {}}, "is not a valid safetensors index"),
        ([{"weight_map": {}}], "is not a valid safetensors index"),
        ({"weight_map": {NORM: 5}}, f"the shard of tensor '{NORM}' must be a file name, got 5"),
        ({"weight_map": {NORM: None}}, "must be a file name, got null"),
        ({"weight_map": {NORM: "../model.safetensors"}}, "is outside the model folder"),
        ({"weight_map": {NORM: "/etc/passwd"}}, "shard '/etc/passwd' of tensor"),
    ],
)
def test_malformed_index(tiny_checkpoint, index, needle):
    _, path = tiny_checkpoint
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as info:
        load_model(path)
    message = str(info.value)
    assert message.startswith(str(path / "model.safetensors.index.json")), message
    assert needle in message and "\n" not in message, message


def test_a_tensor_in_two_shards_is_refused(tiny_checkpoint):
    _, path = tiny_checkpoint
    shutil.copy(path / "model.safetensors", path / "copy.safetensors")
    index = {"weight_map": {NORM: "model.safetensors", "x": "copy.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError,
        match=r"tensor '[\w.]+' is in both copy\.safetensors and model\.safetensors",
    ):
        load_model(path)


def _keys(path):
    with safe_open(path / "model.safetensors", "pt") as file:
        return set(file.keys())


def test_gpt_neox_checkpoint_saved_by_transformers(tmp_path):
    """transformers saves GPT-NeoX's head as `embed_out` (Pythia's layout) and renames it
    to `lm_head` when loading, by its conversion mapping: so does the loader."""
    zoo.build("gpt_neox", num_layers=2).save_pretrained(tmp_path)
    assert "embed_out.weight" in _keys(tmp_path) and "lm_head.weight" not in _keys(tmp_path)
    loaded, _ = load_model(tmp_path)
    ids = zoo.inputs()
    assert torch.equal(zoo.logits(loaded, ids), zoo.logits(zoo.load_on_cpu(tmp_path), ids))


@pytest.mark.parametrize("arch", ["gpt2", "opt", "llama"])
def test_checkpoint_of_the_base_model(tmp_path, arch):
    """Keys without the base model's prefix (`h.0...`, `decoder...`, `layers...`, the
    layout of a saved base model) are found under it, as transformers does; the tied
    head follows the embeddings."""
    model = zoo.build(arch, num_layers=2)
    model.config.tie_word_embeddings = True
    model.config.save_pretrained(tmp_path)
    base = {k: v.contiguous() for k, v in model.base_model.state_dict().items()}
    save_file(base, tmp_path / "model.safetensors", metadata={"format": "pt"})
    prefix = model.base_model_prefix
    assert not any(key.startswith(f"{prefix}.") for key in _keys(tmp_path))
    loaded, _ = load_model(tmp_path)
    ids = zoo.inputs()
    assert torch.equal(zoo.logits(loaded, ids), zoo.logits(zoo.load_on_cpu(tmp_path), ids))


def test_base_model_checkpoint_without_a_head_is_refused(tmp_path):
    model = zoo.build("llama", num_layers=2)  # lm_head not tied: it must be in the checkpoint
    model.config.save_pretrained(tmp_path)
    save_file(model.model.state_dict(), tmp_path / "model.safetensors")
    with pytest.raises(ModelError, match=r"does not match .* missing \['lm_head.weight'\]"):
        load_model(tmp_path)


def test_one_tensor_under_two_names_is_refused(tiny_checkpoint):
    model, path = tiny_checkpoint
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    tensors["norm.weight"] = tensors[NORM].clone()
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelError, match=r"has both 'model\.norm\.weight' and 'norm\.weight' for"):
        load_model(path)


MOE_SETTINGS = {
    "resident": None,
    "uva": {"cpu_offload_gb": 0.0002},
    "prefetch": {"offload_group_size": 1, "offload_prefetch_step": 2},
    "prefetch-bf16": {"offload_group_size": 2, "offload_num_in_group": 1},
}


@pytest.mark.parametrize("setting", list(MOE_SETTINGS))
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_per_expert_checkpoints_are_stacked_as_transformers_does(tmp_path, arch, setting):
    """transformers saves a mixture's experts one tensor each (the hub's layout) and
    stacks them into `experts.gate_up_proj` / `down_proj` when loading: the loader reads
    each expert's tensor straight into its slice of the stacked parameter."""
    model = zoo.build(arch, num_layers=2)
    model.save_pretrained(tmp_path)
    assert any(".experts.1." in key for key in _keys(tmp_path))  # one tensor per expert
    dtype = "bfloat16" if setting.endswith("bf16") else "auto"
    loaded, offloader = load_model(tmp_path, MOE_SETTINGS[setting], dtype=dtype)
    expected = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=loaded.dtype).eval()
    for name, tensor in expected.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    ids = zoo.inputs()
    assert torch.equal(zoo.logits(loaded, ids), zoo.logits(expected, ids))
    if setting != "resident":
        experts = [e for e in offloader.manifest() if ".experts." in e.name]
        assert experts, "the stacked experts were offloaded"


def _moe_checkpoint(path, drop=None, reshape=None):
    zoo.build("qwen3_moe", num_layers=1).save_pretrained(path)
    with safe_open(path / "model.safetensors", "pt") as file:
        tensors = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (
            {"drop": "model.layers.0.mlp.experts.1.up_proj.weight"},
            "model.layers.0.mlp.experts.gate_up_proj: the checkpoint's experts are [0, 2, 3]",
        ),
        (
            {"reshape": "model.layers.0.mlp.experts.2.down_proj.weight"},
            "model.layers.0.mlp.experts.down_proj: the checkpoint's parts of one kind differ",
        ),
    ],
)
def test_incomplete_experts_are_one_model_error(tmp_path, damage, needle):
    _moe_checkpoint(tmp_path, **damage)
    with pytest.raises(ModelError) as info:
        load_model(tmp_path)
    assert needle in str(info.value)


PEAK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from offload.model.build import build_empty
    from offload.model.loader import load_model
    from offload.offloader.layers import find_layers

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


@pytest.fixture(scope="module")
def large_llama(tmp_path_factory):
    """A ~400 MB checkpoint, written once for the tests that only read it."""
    return zoo.save_large_llama(tmp_path_factory.mktemp("big") / "big")


@pytest.mark.parametrize("config", [{"offload_group_size": 1}, {"cpu_offload_gb": 0.2}, None])
def test_peak_host_memory_is_one_copy_of_the_weights(large_llama, config):
    """A fresh process loads a ~400 MB checkpoint: its peak RSS grows by no more than the
    weights themselves (all in host memory here: the CPU is the device) plus one layer
    and a little slack, never by a second copy of the model."""
    result = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(large_llama), json.dumps(config)],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["total"] > 350e6
    assert figures["growth"] <= figures["total"] + figures["largest"] + 64 * 2**20, figures


def test_old_rotary_buffers_in_a_checkpoint_are_ignored_as_transformers_does(tmp_path):
    model = zoo.build("llama", num_layers=2)
    model.config.save_pretrained(tmp_path)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded, _ = load_model(tmp_path)
    ids = zoo.inputs()
    assert torch.equal(zoo.logits(loaded, ids), zoo.logits(model, ids))
    tensors["model.layers.0.self_attn.surprise"] = torch.ones(4)  # others are still refused
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"unexpected.*surprise"):
        load_model(tmp_path)
