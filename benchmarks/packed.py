"""Quantized safetensors checkpoints (GPTQ, compressed-tensors W4A16 / W8A16, FP8) against the
float32 model of the same values, resident decode on the CPU, SmolLM2-135M's shape with
random weights (no checkpoint of these formats ships in a package).

    python benchmarks/packed.py [--tokens 16] [--rounds 5] [--layers 30]

Each round runs every checkpoint once (interleaved), batch 1; the figure is the median of
the rounds' decode tok/s (the prefill's time left out: first token to last). Beside it, the
weight bytes a step reads and the float32 model's read bound at the RAM read rate measured
here. The packed formats de-quantize each weight per forward (no int4/int8 kernel yet), so
they read fewer bytes but compute more: this says by how much.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
import common

from offload import LLM, SamplingParams

GROUP = 64  # (576 inputs are not whole groups of 128)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="offload-packed-") as root:
        folders = _write(Path(root), args.layers)
        llms = {name: LLM(path, device="cpu", dtype="float32") for name, path in folders.items()}
        params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        prompt = "The capital of France is"
        rates: dict[str, list[float]] = {name: [] for name in llms}
        for llm in llms.values():  # warm-up
            llm.generate([prompt], params, use_tqdm=False)
        for _ in range(args.rounds):
            for name, llm in llms.items():
                rates[name].append(_decode_rate(llm, prompt, params))
        stored = {name: _layer_bytes(llm) for name, llm in llms.items()}
        for llm in llms.values():
            llm.close()
    from cpu_step import read_gb_per_s

    read = read_gb_per_s()
    results = {}
    base = statistics.median(rates["float32"])
    print(f"batch 1, {args.tokens} tokens, {args.rounds} rounds, threads {torch.get_num_threads()}, "
          f"read {read:.1f} GB/s: each form's read bound beside it")  # fmt: skip
    for name, values in rates.items():
        rate = statistics.median(values)
        results[name] = {
            "tokens_per_s": rate,
            "round_tokens_per_s": values,
            "layer_bytes_per_step": stored[name],
            "vs_float32": rate / base,
            "layer_read_bound_tokens_per_s": read * 1e9 / stored[name],
        }
        print(f"{name:>10}: {rate:6.2f} tok/s ({rate / base:4.2f}x float32), layers read "
              f"{stored[name] / 2**20:6.1f} MiB a step, bound {read * 1e9 / stored[name]:6.1f} tok/s")  # fmt: skip
    payload = {"tokens": args.tokens, "rounds": args.rounds, "layers": args.layers,
               "threads": torch.get_num_threads(), "read_gb_per_s": read, "results": results}  # fmt: skip
    print(f"saved {common.save('packed-cpu', torch.device('cpu'), payload)}")


def _decode_rate(llm, prompt, params) -> float:
    """Decode tok/s: the time of `params.max_tokens` tokens less that of one (the prefill)."""
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([prompt], one, use_tqdm=False)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    total = time.perf_counter() - start
    return (params.max_tokens - 1) / max(total - prefill, 1e-9)


def _layer_bytes(llm) -> int:
    layers = llm.model.model.layers
    return sum(p.numel() * p.element_size() for p in layers.parameters())


def _write(root: Path, layers: int) -> dict[str, Path]:
    """The float checkpoint and each quantized form of it, SmolLM2-135M's shape."""
    import transformers as tf

    config = tf.LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config)
    floats = root / "float32"
    model.save_pretrained(floats)
    tokenizer_of(floats)
    tensors = load_file(floats / "model.safetensors")
    folders = {"float32": floats}
    for name, quantize in (
        ("gptq-w4", _gptq),
        ("ct-w4a16", _ct4),
        ("ct-w8a16", _ct8),
        ("fp8", _fp8),
    ):
        out = root / name
        out.mkdir()
        for file in floats.iterdir():
            if file.suffix != ".safetensors":
                (out / file.name).write_bytes(file.read_bytes())
        packed, settings = {}, None
        for key, value in tensors.items():
            if ".layers." in key and key.endswith("proj.weight"):
                parts, settings = quantize(value)
                packed.update({f"{key.removesuffix('weight')}{k}": v for k, v in parts.items()})
            else:
                packed[key] = value
        save_file(packed, out / "model.safetensors", metadata={"format": "pt"})
        settings_file = json.loads((out / "config.json").read_text())
        settings_file["quantization_config"] = settings
        (out / "config.json").write_text(json.dumps(settings_file))
        folders[name] = out
    return folders


def tokenizer_of(path: Path) -> None:
    from offload.model.default import default_model_path

    for file in default_model_path().iterdir():  # the default model's tokenizer (same vocab)
        if file.name.startswith(("tokenizer", "special_tokens")):
            (path / file.name).write_bytes(file.read_bytes())


def _groups(weight: torch.Tensor, bits: int):
    """Symmetric integers in [0, 2^bits) by groups of GROUP inputs, and their scales."""
    grouped = weight.unflatten(-1, (-1, GROUP))
    scale = grouped.abs().amax(-1) / ((1 << (bits - 1)) - 1)
    q = (grouped / scale.unsqueeze(-1)).round().clamp(-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
    return q.flatten(-2).long() + (1 << (bits - 1)), scale


def _words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Values along the last dimension packed low bits first into int32 words."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    words = (values.unflatten(-1, (-1, per)) << shifts).sum(-1)
    return (words - ((words >> 31) << 32)).to(torch.int32)


def _gptq(weight):
    q, scale = _groups(weight, 4)  # [out, in], [out, groups]
    zeros = torch.full_like(scale, 8, dtype=torch.long)
    parts = {
        "qweight": _words(q, 4).T.contiguous(),  # [in / 8, out]: packed along the inputs
        "qzeros": _words((zeros - 1).T.contiguous(), 4),  # [groups, out / 8]; v1 stores z - 1
        "scales": scale.T.contiguous().half(),
        "g_idx": (torch.arange(weight.shape[1]) // GROUP).to(torch.int32),
    }
    settings = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
                "sym": True, "checkpoint_format": "gptq"}  # fmt: skip
    return parts, settings


def _ct(weight, bits, group):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    if group:
        q, scale = _groups(weight, bits)
    else:
        scale = weight.abs().amax(-1, keepdim=True) / ((1 << (bits - 1)) - 1)
        q = (weight / scale).round().clamp(-(1 << (bits - 1)), (1 << (bits - 1)) - 1).long()
        q = q + (1 << (bits - 1))
    signed = (q - (1 << (bits - 1))).to(torch.int8)
    parts = {
        "weight_packed": pack_to_int32(signed, bits),
        "weight_scale": scale.bfloat16(),
        "weight_shape": torch.tensor(list(weight.shape)),
    }
    weights = {"num_bits": bits, "type": "int", "symmetric": True,
               "strategy": "group" if group else "channel", "group_size": GROUP if group else None}  # fmt: skip
    settings = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "format": "pack-quantized"}},
                "ignore": ["lm_head"]}  # fmt: skip
    return parts, settings


def _ct4(weight):
    return _ct(weight, 4, True)


def _ct8(weight):
    return _ct(weight, 8, False)


def _fp8(weight):
    scale = weight.abs().amax() / 448.0
    parts = {"weight": (weight / scale).to(torch.float8_e4m3fn), "weight_scale": scale.float()}
    return parts, {"quant_method": "fp8", "activation_scheme": "dynamic"}


if __name__ == "__main__":
    main()
