"""The default model's GGUF read as stored (`quantization="gguf"`).

In GGUF's own blocks (`kernels="gguf"`, any device): the file's bytes in the cache, modules
that de-quantize to transformers' float32 weights bit for bit, the same tokens and logprobs
as the float32 model. Laid out for the CPU's kernels (the default on the CPU): the file's
values in the q4 layout (torch's int4 packing on a CPU without VNNI), tokens that agree
with the float32 model, perplexity within 0.1% of it, and offloading that moves the stored
bytes and gives the resident answer bitwise."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import zoo
from gguf_files import folder_tensors
from safetensors.torch import load_file, save_file

from offload import LLM, SamplingParams
from offload.engine import cpu_step
from offload.errors import ConfigError, ModelError
from offload.memory.safetensors import REFERENCES
from offload.model.build import build_empty
from offload.model.default import gguf_path
from offload.model.gguf_fast import FastReader
from offload.model.loader import load_model
from offload.model.sources import resolve_model, stored_unless_asked
from offload.planner.shape import shape_of
from offload.probes.compute import time_decode
from offload.probes.layout_choice import LayoutChooser
from offload.quant import kernels, layouts
from offload.quant.gguf_quants import affine_4bit, dequantize
from offload.quant.kernels import int4_matmul
from offload.quant.layouts import int4_cuda_layout, layout_for, q4_values
from offload.quant.quantized import (
    GGUFEmbedding,
    GGUFLinear,
    Int4Linear,
    Q4Linear,
    Q8Embedding,
    Q8Linear,
    rows_in_hf_order,
)

# The CPU's layout of a 4-bit weight here (q4 where the CPU has VNNI), and its module.
FOUR_BIT = layout_for("Q4_1", "model.layers.0.mlp.up_proj.weight", "cpu")
FOUR_BIT_LINEAR = {"q4": Q4Linear, "int4": Int4Linear}.get(FOUR_BIT, GGUFLinear)

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
PROMPTS = ["What is the capital of France?", "1, 2, 3,"]


@pytest.fixture(scope="module")
def blocks():
    return resolve_model(None, quantization="gguf", kernels="gguf")


@pytest.fixture(scope="module")
def stored():
    # (on the CPU: laid out for its kernels, each layout measured)
    return resolve_model(None, quantization="gguf", layout_chooser=LayoutChooser)


@pytest.fixture(scope="module")
def file_tensors():
    return {t.name: np.asarray(t.data) for t in FastReader(gguf_path()).tensors}


@pytest.fixture(scope="module")
def stored_outputs(stored):
    with LLM(stored, device="cpu") as llm:
        return _tokens_and_logprobs(llm)


def _tokens_and_logprobs(llm):
    return [
        (o.outputs[0].token_ids, o.outputs[0].logprobs)
        for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    ]


def test_the_cpu_layout_holds_the_files_values(stored, file_tensors):
    """4-bit weights: the file's 4-bit values, its scales and minimums as they are (q4),
    or as bfloat16 scale and zero point (torch's int4 packing); the Q8_0 table: the file's
    bytes by block column."""
    tensors = folder_tensors(stored)
    settings = json.loads((stored / "config.json").read_text())["quantization_config"]
    assert settings["weight_layouts"]["model.layers.3.mlp.up_proj.weight"] == FOUR_BIT
    raw = torch.from_numpy(file_tensors["blk.3.ffn_up.weight"])
    q, scale, offset = affine_4bit(raw, "Q4_1")
    packed = tensors["model.layers.3.mlp.up_proj.weight"]
    if FOUR_BIT == "q4":
        scales, offsets = (
            tensors[f"model.layers.3.mlp.up_proj.{n}"] for n in ("scales", "offsets")
        )
        values = q4_values(packed, torch.ones_like(scales), torch.zeros_like(offsets))
        assert torch.equal(values, q.float())  # q * 1 + 0: the stored integers
        assert torch.equal(scales, scale.T.half()) and torch.equal(offsets, offset.T.half())
        assert torch.equal(scales.float(), scale.T) and torch.equal(offsets.float(), offset.T)
    else:
        scale_zero = tensors["model.layers.3.mlp.up_proj.scale_zero"]
        unit = torch.stack([torch.ones_like(scale), torch.full_like(scale, 8)], -1).transpose(0, 1)
        values = int4_matmul(torch.eye(q.shape[1]), packed, unit.bfloat16().contiguous())
        assert torch.equal(values.T, q.float())  # (q - 8) * 1 + 8: the stored integers
        assert torch.equal(scale_zero[..., 0], scale.T.bfloat16())
        assert torch.equal(scale_zero[..., 1], (offset + 8 * scale).T.bfloat16())
    table = file_tensors["token_embd.weight"].reshape(49152, 18, 34)
    values, scales = tensors["model.embed_tokens.weight"], tensors["model.embed_tokens.scales"]
    assert np.array_equal(values.numpy().transpose(1, 0, 2), table[..., 2:].view(np.int8))
    assert np.array_equal(scales.numpy().T, table[..., :2].copy().view(np.float16)[..., 0])
    assert (stored / "model.safetensors").stat().st_size <= gguf_path().stat().st_size


def test_dequantized_weights_equal_transformers_float32_conversion(blocks, smollm2_path):
    """transformers reads the GGUF into the float32 default model: every weight we keep as
    stored de-quantizes to exactly its tensor (names, row order and values)."""
    ours = folder_tensors(blocks)
    settings = json.loads((blocks / "config.json").read_text())["quantization_config"]
    types = settings["weight_types"]
    for name, heads in settings["rotary_rows"].items():
        ours[name] = rows_in_hf_order(ours[name], heads)
    theirs = load_file(smollm2_path / "model.safetensors")
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # (tied to the embedding)
    for name, tensor in ours.items():
        values = dequantize(tensor, types[name]) if name in types else tensor
        assert torch.equal(values, theirs[name]), name


@pytest.mark.parametrize(
    ("layout", "embedding", "head", "linear"),
    [("blocks", GGUFEmbedding, GGUFLinear, GGUFLinear), ("stored", Q8Embedding, Q8Linear, FOUR_BIT_LINEAR)],
)  # fmt: skip
def test_the_model_is_built_with_quantized_modules(layout, embedding, head, linear, request):
    with LLM(request.getfixturevalue(layout), device="cpu") as llm:
        model = llm.model
        assert isinstance(model.model.embed_tokens, embedding)
        assert (
            isinstance(model.lm_head, head)
            and model.lm_head.weight is model.model.embed_tokens.weight
        )
        q_proj = model.model.layers[0].self_attn.q_proj
        assert isinstance(q_proj, linear) and q_proj.kind == "Q4_1"
        assert q_proj.weight.dtype == torch.uint8
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        assert held < 100 * 2**20  # 4-5 bits a weight, not 32


def test_greedy_tokens_and_logprobs_equal_the_float32_models(blocks, smollm2_path):
    """Each prompt alone: bitwise. (Batched, the float32 model's lm_head product over a
    strided [2, 576] input rounds differently with where its weight lies in memory, so a
    batch is compared by tokens.)"""
    with LLM(blocks, device="cpu") as quantized, LLM(smollm2_path, device="cpu") as floats:
        for prompt in PROMPTS:
            ours = quantized.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
            theirs = floats.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
            assert (ours.token_ids, ours.logprobs) == (theirs.token_ids, theirs.logprobs)
        batched = [o.outputs[0].token_ids for o in floats.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert batched == [o.outputs[0].token_ids for o in quantized.generate(PROMPTS, GREEDY)]


# A fixed text for perplexity (written for this test).
TEXT = (
    "The river runs through the middle of the old town, under seven stone bridges. Every "
    "morning the bakers open their shutters before the sun is up, and the smell of bread "
    "drifts over the water. Children cross the bridges on their way to school, stopping to "
    "watch the boats go by. In the afternoon the market fills the main square with fruit, "
    "cheese, flowers and fish, and the sellers call out their prices to everyone who "
    "passes. When evening comes, the lamps along the river are lit one by one, and people "
    "walk slowly along the banks, talking about the day."
)


def test_the_cpu_kernels_agree_with_the_float32_model(stored, smollm2_path):
    """The stored model's products round differently from float32 (the q4 kernel rounds
    each input group to 15-bit integers; torch's int4 and int8 kernels take bfloat16), so
    answers are compared by rate, not bitwise: on a fixed text, the most likely next token
    agrees at >= 97% of positions (117 of 117 measured, 116 with torch's int4) and
    perplexity is within 0.1% of the float32 model's with q4 (measured: 0.002%; torch's
    int4: 0.09%, bounded at 1%); the short question gets the float32 model's answer."""
    params = SamplingParams(temperature=0, max_tokens=12)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    with LLM(stored, device="cpu") as quantized, LLM(smollm2_path, device="cpu") as floats:
        ours, theirs = zoo.predictions(quantized, TEXT), zoo.predictions(floats, TEXT)
        answers = [
            llm.chat(question, params, use_tqdm=False)[0].outputs[0] for llm in (quantized, floats)
        ]
    assert answers[0].text == "The capital of France is Paris."
    assert answers[0].token_ids == answers[1].token_ids
    agree = sum(a[1] == b[1] for a, b in zip(ours, theirs, strict=True)) / len(ours)
    assert agree >= 0.97, agree
    perplexities = [math.exp(-sum(p[0] for p in side) / len(side)) for side in (ours, theirs)]
    bound = 0.001 if FOUR_BIT == "q4" else 0.01
    assert abs(perplexities[0] / perplexities[1] - 1) <= bound, perplexities


@pytest.mark.parametrize(
    "flags",
    [
        {"offload_group_size": 1, "offload_num_in_group": 1, "offload_prefetch_step": 2},
        {"cpu_memory_gb": 0, "disk_io": "direct"},
        {"cpu_memory_gb": 0, "disk_io": "mmap"},
        {"cpu_offload_gb": 0.05, "kv_offload": True},
    ],
    ids=["prefetch", "disk-direct", "disk-mmap", "uva+kv"],
)
def test_offloaded_as_stored_equals_resident_and_moves_the_stored_bytes(
    stored, stored_outputs, flags
):
    with LLM(stored, device="cpu", **flags) as llm:
        assert _tokens_and_logprobs(llm) == stored_outputs
        stats = llm.transfer_stats()
        offloaded = llm.offloader.offloaded_bytes
    moved = stats.weight_copied_bytes + stats.disk_read_bytes + stats.disk_mapped_bytes
    if "offload_prefetch_step" in flags or "disk_io" in flags:
        # Each forward brings every offloaded layer's stored bytes, never a float copy (the
        # prefetcher may have begun the next forward's first layers).
        forwards = stats.num_forwards
        assert forwards * offloaded <= moved <= (forwards + 1) * offloaded, (moved, forwards)
        assert offloaded < 70 * 2**20  # 30 layers of Q4_1 blocks (as float32: 405 MiB)
    if "kv_offload" in flags:
        assert stats.kv_copied_bytes > 0


@pytest.fixture(scope="module")
def two_layers(stored, tmp_path_factory):
    """The stored model cut to its first two layers (a quick compile)."""
    out = tmp_path_factory.mktemp("two-layers")
    for file in stored.iterdir():
        if file.suffix != ".safetensors" and file.name not in ("config.json", REFERENCES):
            shutil.copy(file, out / file.name)
    settings = json.loads((stored / "config.json").read_text())
    settings["num_hidden_layers"] = 2

    def kept(name):
        return not re.match(r"model\.layers\.([2-9]|\d\d)\.", name)

    quantized = settings["quantization_config"]
    for key in ("weight_types", "weight_layouts"):
        quantized[key] = {name: v for name, v in quantized[key].items() if kept(name)}
    (out / "config.json").write_text(json.dumps(settings))
    tensors = folder_tensors(stored)
    save_file({name: t for name, t in tensors.items() if kept(name)}, out / "model.safetensors")
    return out


def test_compiled_offloaded_equals_compiled_resident(two_layers):
    """Inductor, fullgraph: the prefetched model gives the compiled resident model's logits
    bitwise (each stored weight's product and lookup is one opaque op: fused with the
    graph around it, a multiply and a later add became one rounding in one graph only)."""
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 4649, 30, 198]])
    torch._dynamo.reset()
    resident, _ = load_model(two_layers)
    with torch.no_grad():
        expected = torch.compile(resident, fullgraph=True)(input_ids=ids).logits
    torch._dynamo.reset()
    flags = {"offload_group_size": 1, "offload_num_in_group": 1, "offload_prefetch_step": 1}
    model, offloader = load_model(two_layers, flags)
    with torch.no_grad():
        assert torch.equal(torch.compile(model, fullgraph=True)(input_ids=ids).logits, expected)
    offloader.sync_prev_onload()
    copied, offloaded = offloader.stats().bytes_copied, offloader.offloaded_bytes
    assert offloaded <= copied <= 2 * offloaded  # (the next forward's first layer may be in)
    offloader.close()
    torch._dynamo.reset()


def test_quantization_is_checked_before_anything_is_read(tmp_path, smollm2_path):
    with pytest.raises(
        ConfigError, match=r"quantization='bitsandbytes' is not supported \(yet; read: gguf, "
    ):
        LLM(quantization="bitsandbytes")
    with pytest.raises(
        ConfigError, match=r"quantization must be None or one of gguf, .*; got 'int3'"
    ):
        LLM(quantization="int3")
    with pytest.raises(ModelError, match=r"quantization='gptq' needs a checkpoint quantized that"):
        LLM(quantization="gptq")
    with pytest.raises(ModelError, match=r"needs a \.gguf file or a folder offload made from one"):
        LLM(smollm2_path, quantization="gguf")


def test_a_gguf_runs_as_stored_on_the_cpu_unless_a_dtype_is_asked_for(stored, smollm2_path):
    cpu, gpu, gguf_file = torch.device("cpu"), torch.device("cuda", 0), str(gguf_path())
    assert stored_unless_asked(None, None, "auto", cpu) == "gguf"
    assert stored_unless_asked(gguf_file, None, "auto", cpu) == "gguf"
    for dtype in ("float32", torch.float32, "bfloat16"):
        assert stored_unless_asked(gguf_file, None, dtype, cpu) is None
    assert stored_unless_asked(smollm2_path, None, "auto", cpu) is None  # a float folder
    # A GPU keeps it as stored where torch's GPU int4 kernel runs (sm_80 and later).
    on_gpu = "gguf" if int4_cuda_layout() is not None else None
    assert stored_unless_asked(None, None, "auto", gpu) == on_gpu
    assert stored_unless_asked(None, None, "float32", gpu) is None
    assert stored_unless_asked(None, "gguf", "auto", gpu) == "gguf"
    with LLM(device="cpu", max_model_len=64) as llm:  # the default model, no argument
        assert isinstance(llm.model.model.layers[0].mlp.up_proj, FOUR_BIT_LINEAR)
        assert cpu_step.pays(llm.model)  # (its decode step of one sequence is compiled)
    with LLM(device="cpu", dtype="float32", max_model_len=64) as llm:
        assert isinstance(llm.model.model.layers[0].mlp.up_proj, torch.nn.Linear)
        assert llm.model.model.layers[0].mlp.up_proj.weight.dtype == torch.float32


def test_a_rows_product_does_not_depend_on_the_rows_beside_it(stored):
    """A request's logits must not depend on how many others share its decode step: each
    stored product gives a row what it gives that row alone (float32 GEMM noise aside; the
    int8 kernel's bfloat16 activations at one row moved the head's logits by 0.06)."""
    model, _ = load_model(stored)
    layer = model.model.layers[0]
    torch.manual_seed(0)
    with torch.no_grad():
        for module in (layer.mlp.up_proj, layer.mlp.down_proj, model.lm_head):
            x = torch.randn(8, module.in_features)
            alone = torch.cat([module(x[i : i + 1]) for i in range(8)])
            assert (module(x) - alone).abs().max() < 1e-4, type(module).__name__


@pytest.mark.parametrize("rows", [9, 33])
@pytest.mark.parametrize("offsets", [False, True])
def test_a_q8_product_of_many_rows_by_weight_slices_gives_the_whole_weights_bits(
    rows, offsets, monkeypatch
):
    """Past `Q8_FEW_ROWS` rows the q8 product runs a slice of weight rows at a time (the
    sums stay in the cache); each output is the same sum, so it has the same bits (with
    the offsets of Q5_1/Q5_K too, each slice's own)."""
    torch.manual_seed(0)
    values = torch.randint(-127, 128, (6, 1000, 32), dtype=torch.int8)
    scales = (torch.rand(6, 1000) / 64).half()
    shifts = (torch.randn(6, 1000) / 8).half() if offsets else None
    x = torch.randn(rows, 6 * 32)
    monkeypatch.setattr(kernels, "Q8_FEW_ROWS", 64)
    whole = kernels.q8_matmul(x, values, scales, shifts)
    floats = layouts.q8_values(values, scales, shifts)
    exact = x.double() @ floats.double().T  # (a VNNI CPU's integer sums: inputs to 15 bits)
    assert ((whole.double() - exact).norm() / exact.norm()) < 2e-4
    monkeypatch.setattr(kernels, "Q8_FEW_ROWS", 8)
    monkeypatch.setattr(kernels, "Q8_SLICE", 96)  # (the last slice shorter)
    assert torch.equal(kernels.q8_matmul(x, values, scales, shifts), whole)


def test_the_planner_times_a_layer_of_the_stored_model(stored):
    """The probes cut the model to its first layers: its config then names only their
    quantized weights, and a layer takes time."""
    empty = build_empty(stored, "auto")
    layer_s, rest_s = time_decode(
        stored, shape_of(empty, 64), torch.device("cpu"), [1], 64, warmup=1, repeats=2
    )
    assert layer_s[0] > 0 and rest_s[0] >= 0


PEAK = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from offload.model.build import build_empty
    from offload.model.loader import load_model

    path = Path(sys.argv[1])
    build_empty(path, "auto")  # imports the model's code first: not part of loading
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    before = status("VmRSS")
    model, offloader = load_model(path)
    print(json.dumps({"growth": status("VmHWM") - before}))
    """
)


def test_loading_as_stored_grows_rss_by_at_most_one_and_a_half_ggufs(stored):
    result = subprocess.run(
        [sys.executable, "-c", PEAK, str(stored)], capture_output=True, text=True, check=True,
        timeout=300,
    )  # fmt: skip
    growth = json.loads(result.stdout.strip().splitlines()[-1])["growth"]
    assert 0 < growth <= 1.5 * gguf_path().stat().st_size, growth / 2**20


def test_each_layout_is_the_fastest_measured_for_its_type_and_shape(stored):
    """The CPU layout of each quantized weight is the one whose one-row product timed
    fastest here for its type and shape (the kernel's within 25%); the seconds are in the
    config."""
    settings = json.loads((stored / "config.json").read_text())["quantization_config"]
    seconds, types = settings["layout_seconds"], settings["weight_types"]
    layouts = settings.get("weight_layouts", {})
    tensors = folder_tensors(stored)
    assert any({FOUR_BIT, "gguf"} == set(s) for s in seconds.values())
    for name, kind in types.items():
        layout = layouts.get(name)
        rows = tensors[name].shape[1] if layout == "q8" else tensors[name].shape[0]
        rows = tensors[name.replace(".weight", ".scales")].shape[1] if layout == "q4" else rows
        key = next((k for k in seconds if k.startswith(f"{kind} {rows}x")), None)
        if key is None:  # (a type with one possible layout: nothing to choose)
            assert layouts.get(name, "gguf") == "gguf"
            continue
        chosen, timed = layouts.get(name, "gguf"), seconds[key]
        assert all(timed[chosen] <= 1.25 * other for other in timed.values()), (name, timed)
