"""The workload's checks (each error names the field, the value and what is allowed) and
the random checkpoint a shape becomes."""

import json

import pytest
import torch
from safetensors.torch import load_file

from offload.bench.checkpoint import write_random_checkpoint
from offload.bench.workload import Workload, prepare, resolve_checkpoint
from offload.errors import ConfigError
from offload.model.loader import load_model
from offload.quant.gguf_quants import dequantize
from offload.quant.layouts import layout_for
from offload.quant.quantized import Int4Linear, Q4Linear


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"batch_sizes": (0,)}, r"batch_sizes \(--batch-sizes\) must be .* >= 1, got \[0\]"),
        ({"batch_sizes": ()}, r"batch_sizes .* one or more integers >= 1, got \[\]"),
        ({"batch_sizes": (1, 2.5)}, r"got \[1, 2.5\]"),
        ({"prompt_len": 0}, r"prompt_len \(--prompt-len\) must be an integer >= 1, got 0"),
        ({"output_len": 1}, r"output_len \(--output-len\) must be an integer >= 2, got 1"),
        ({"rounds": 0}, r"rounds \(--rounds\) must be an integer >= 1, got 0"),
        ({"dtype": "int8"}, r"dtype \(--dtype\) must be auto, float32, .*got 'int8'"),
        (
            {"quantization": "bitsandbytes"},
            r"quantization \(--quantization\)='bitsandbytes' is not supported \(yet; read: gguf, ",
        ),
        ({"quantization": "q3"}, r"quantization \(--quantization\) must be None or one of gguf"),
    ],
)
def test_bad_fields_are_named_with_what_is_allowed(fields, message):
    with pytest.raises(ConfigError, match=message):
        Workload(**fields)


def test_batch_sizes_are_sorted_once_each():
    assert Workload(batch_sizes=(8, 1, 8)).batch_sizes == (1, 8)


def test_an_unknown_model_lists_the_shipped_shapes(tmp_path):
    with pytest.raises(ConfigError, match=r"model folder or a shipped shape \(llama-3-70b, .*'x'"):
        resolve_checkpoint("x", "auto")
    with pytest.raises(ConfigError, match=r"no config\.json"):
        resolve_checkpoint(str(tmp_path), "auto")


def _tiny_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    shape = tmp_path / "tiny-shape"
    shape.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
        "dtype": "bfloat16",
    }
    (shape / "config.json").write_text(json.dumps(config))
    return shape


def test_a_shape_becomes_a_random_checkpoint_written_once(tmp_path, monkeypatch):
    shape = _tiny_shape(tmp_path, monkeypatch)
    path, name = resolve_checkpoint(str(shape), "float32")
    assert name == "tiny-shape (random weights)"
    assert path.parent == tmp_path / "cache" / "bench" and path.name.startswith(
        "tiny-shape-float32"
    )
    written = {file: file.stat().st_mtime_ns for file in path.iterdir()}
    assert resolve_checkpoint(str(shape), "float32")[0] == path  # reused, not rewritten
    assert {file: file.stat().st_mtime_ns for file in path.iterdir()} == written
    prepared = prepare(Workload(model=str(shape), dtype="float32", device="cpu"))
    assert len(prepared.layer_bytes) == 3 and prepared.files
    assert prepared.outside_layers_bytes == prepared.total_bytes - sum(prepared.layer_bytes)
    assert resolve_checkpoint(str(shape), "auto")[0].name.startswith("tiny-shape-bfloat16")


def test_a_quantized_shape_keeps_its_matrices_as_q4_0_blocks(tmp_path, monkeypatch):
    """`offload bench --model <shape> -q gguf`: every matrix as GGUF Q4_0 (4.5 bits a
    weight) with values of the float checkpoint's spread, the norms in the dtype."""
    shape = _tiny_shape(tmp_path, monkeypatch)
    config = json.loads((shape / "config.json").read_text())
    folder = tmp_path / "blocks"
    files = write_random_checkpoint(folder, config, 10**6, quantized="Q4_0")
    types = json.loads((folder / "config.json").read_text())["quantization_config"]
    tensors = {}
    for file in files:
        tensors.update(load_file(file))
    floats = prepare(Workload(model=str(shape), dtype="bfloat16", device="cpu"))
    matrices = {name for name, t in load_file(floats.files[0]).items() if t.dim() == 2}
    assert set(types["weight_types"]) == matrices and set(types["weight_types"].values()) == {
        "Q4_0"
    }
    up = tensors["model.layers.1.mlp.up_proj.weight"]
    assert up.dtype == torch.uint8 and up.shape == (96, 64 // 32 * 18)
    values = dequantize(up, "Q4_0")
    assert torch.isfinite(values).all() and 0.01 < float(values.std()) < 0.04
    assert tensors["model.norm.weight"].dtype == torch.bfloat16
    # 4.5 bits a matrix weight: under a third of the bfloat16 checkpoint's bytes.
    assert sum(t.numel() * t.element_size() for t in tensors.values()) < floats.total_bytes / 3


def test_a_quantized_shape_is_laid_out_for_the_devices_kernels(tmp_path, monkeypatch):
    """On the CPU the 4-bit matrices go to the CPU's 4-bit layout, as a .gguf would; the
    model built from them computes finite logits."""
    shape = _tiny_shape(tmp_path, monkeypatch)
    prepared = prepare(
        Workload(model=str(shape), dtype="bfloat16", device="cpu", quantization="gguf")
    )
    assert prepared.name == "tiny-shape (Q4_0, random weights)"
    settings = json.loads((prepared.path / "config.json").read_text())["quantization_config"]
    layouts = settings["weight_layouts"]
    four_bit = layout_for("Q4_0", "model.layers.1.mlp.up_proj.weight", "cpu")
    assert layouts["model.layers.1.mlp.up_proj.weight"] == four_bit
    assert "model.embed_tokens.weight" not in layouts  # (looked up by row: GGUF's blocks)
    model, offloader = load_model(prepared.path, device="cpu", dtype=prepared.dtype)
    offloader.close()
    assert isinstance(model.model.layers[1].mlp.up_proj, {"q4": Q4Linear}.get(four_bit, Int4Linear))
    with torch.no_grad():
        logits = model(prepared.prompt_ids(2)[:, :4]).logits
    assert torch.isfinite(logits).all() and float(logits.std()) > 0


def test_prompts_are_the_same_for_every_method_and_differ_by_batch(tiny_llama_path):
    prepared = prepare(Workload(model=str(tiny_llama_path), device="cpu", prompt_len=5))
    ids = prepared.prompt_ids(2)
    assert ids.shape == (2, 5) and bool((ids >= 3).all())
    assert prepared.prompt_ids(2).equal(ids)
    assert not prepared.prompt_ids(3)[:2].equal(ids)
