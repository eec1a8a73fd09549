"""Tiny Llama checkpoints in the quantized safetensors formats vLLM loads (compressed-tensors,
GPTQ, AWQ, FP8), each written here from known integers and scales with the format's own
packing (compressed-tensors' `pack_to_int32`; GPTQ's and AWQ's loops as their packers write
them), beside the float checkpoint of the values they stand for (each format's reference
de-quantization of those integers)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import zoo
from safetensors.torch import load_file, save_file

GROUP = 32
FORMATS = (
    "ct-w4a16", "ct-w4-asym", "ct-w8a16", "ct-int8", "ct-fp8", "gptq", "gptq-act-order",
    "gptq-8bit", "awq", "fp8-block", "fp8-tensor",
)  # fmt: skip


def save_pair(root: Path, fmt: str) -> tuple[Path, Path]:
    """(the quantized checkpoint, the float checkpoint of its de-quantized values)."""
    model = zoo.build("llama", seed=3, num_layers=2)
    floats = zoo.save_with_tokenizer(model, root / f"{fmt}-float")
    quantized = zoo.save_with_tokenizer(model, root / fmt)
    tensors = load_file(floats / "model.safetensors")
    generator = torch.Generator().manual_seed(7)
    floats_of = load_file(floats / "model.safetensors")
    settings = None
    for name in list(tensors):
        stem = name.removesuffix(".weight")
        if ".layers." not in name or not name.endswith("proj.weight"):
            continue
        out_features, in_features = tensors[name].shape
        stored, values, settings = _quantize(fmt, out_features, in_features, generator)
        del tensors[name]
        tensors.update({f"{stem}.{key}": value for key, value in stored.items()})
        floats_of[name] = values.float().contiguous()
    save_file(floats_of, floats / "model.safetensors", metadata={"format": "pt"})
    save_file(tensors, quantized / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = settings
    (quantized / "config.json").write_text(json.dumps(config))
    return quantized, floats


def _quantize(fmt: str, rows: int, columns: int, generator: torch.Generator):
    """(the stored tensors of one weight, the values they stand for, quantization_config)."""
    if fmt.startswith("ct-"):
        return _compressed_tensors(fmt, rows, columns, generator)
    if fmt.startswith("gptq"):
        return _gptq(fmt, rows, columns, generator)
    if fmt == "awq":
        return _awq(rows, columns, generator)
    return _fp8(fmt, rows, columns, generator)


def _scales(shape, dtype, generator):
    return (torch.rand(shape, generator=generator) * 0.02 + 0.005).to(dtype)


def _compressed_tensors(fmt, rows, columns, generator):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    bits = 8 if fmt in ("ct-w8a16", "ct-int8") else 4
    if fmt == "ct-fp8":
        values = (torch.randn(rows, columns, generator=generator) * 100).to(torch.float8_e4m3fn)
        args = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True)
        scale = _scales((rows, 1), torch.bfloat16, generator)
        stored = {"weight": values, "weight_scale": scale}
        expected = dequantize(values, scale, None, args)
        return stored, expected, _ct_settings(args, "float-quantized")
    low, high = -(1 << (bits - 1)), 1 << (bits - 1)
    q = torch.randint(low, high, (rows, columns), generator=generator, dtype=torch.int8)
    grouped = fmt != "ct-w8a16" and fmt != "ct-int8"
    strategy = "group" if grouped else "channel"
    args = QuantizationArgs(
        num_bits=bits,
        type="int",
        symmetric=fmt != "ct-w4-asym",
        strategy=strategy,
        group_size=GROUP if grouped else None,
    )
    scale = _scales((rows, columns // GROUP if grouped else 1), torch.bfloat16, generator)
    zero = None
    if fmt == "ct-w4-asym":
        zero = torch.randint(low, high, scale.shape, generator=generator, dtype=torch.int8)
    expected = dequantize(q, scale, zero, args)
    if fmt == "ct-int8":
        return {"weight": q, "weight_scale": scale}, expected, _ct_settings(args, "int-quantized")
    stored = {
        "weight_packed": pack_to_int32(q, bits),
        "weight_scale": scale,
        "weight_shape": torch.tensor([rows, columns]),
    }
    if zero is not None:
        stored["weight_zero_point"] = pack_to_int32(zero, bits, packed_dim=0)
    return stored, expected, _ct_settings(args, "pack-quantized")


def _ct_settings(args, fmt):
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": args.model_dump(), "format": fmt}
        },
        "ignore": ["lm_head"],
    }


def _gptq(fmt, rows, columns, generator):
    """AutoGPTQ's format v1: q [in, out] packed along the inputs, zeros - 1 along outputs."""
    bits = 8 if fmt == "gptq-8bit" else 4
    per = 32 // bits
    groups = columns // GROUP
    q = torch.randint(0, 1 << bits, (columns, rows), generator=generator, dtype=torch.int64)
    zeros = torch.randint(1, 1 << bits, (groups, rows), generator=generator, dtype=torch.int64)
    scales = _scales((groups, rows), torch.float16, generator)
    g_idx = torch.arange(columns) // GROUP
    if fmt == "gptq-act-order":
        g_idx = g_idx[torch.randperm(columns, generator=generator)]
    qweight = torch.zeros(columns // per, rows, dtype=torch.int64)
    for i in range(columns):
        qweight[i // per] |= q[i] << (bits * (i % per))
    qzeros = torch.zeros(groups, rows // per, dtype=torch.int64)
    for o in range(rows):
        qzeros[:, o // per] |= (zeros[:, o] - 1) << (bits * (o % per))
    expected = scales[g_idx] * (q - zeros[g_idx]).to(torch.float16)  # [in, out]
    stored = {
        "qweight": _int32(qweight),
        "qzeros": _int32(qzeros),
        "scales": scales,
        "g_idx": g_idx.to(torch.int32),
    }
    settings = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": GROUP,
        "desc_act": fmt == "gptq-act-order",
        "sym": False,
        "checkpoint_format": "gptq",
    }
    return stored, expected.T, settings


def _awq(rows, columns, generator):
    """AutoAWQ's GEMM format, packed as its `from_linear` packs."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    groups = columns // GROUP
    q = torch.randint(0, 16, (columns, rows), generator=generator, dtype=torch.int64)
    zeros = torch.randint(0, 16, (groups, rows), generator=generator, dtype=torch.int64)
    scales = _scales((groups, rows), torch.float16, generator)

    def pack(values):
        words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
        for column in range(values.shape[1] // 8):
            for i in range(8):
                words[:, column] |= values[:, column * 8 + order[i]] << (i * 4)
        return _int32(words)

    expanded = zeros.repeat_interleave(GROUP, 0)
    expected = (q - expanded).to(torch.float16) * scales.repeat_interleave(GROUP, 0)
    stored = {"qweight": pack(q), "qzeros": pack(zeros), "scales": scales}
    settings = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": GROUP,
        "version": "gemm",
        "zero_point": True,
    }
    return stored, expected.T, settings


def _fp8(fmt, rows, columns, generator):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    values = (torch.randn(rows, columns, generator=generator) * 100).to(torch.float8_e4m3fn)
    if fmt == "fp8-block":
        scale = _scales((rows // GROUP, columns // GROUP), torch.float32, generator)
        expected = Fp8Dequantize(None)._dequantize_one(values, scale, torch.float32)
        settings = {"quant_method": "fp8", "weight_block_size": [GROUP, GROUP]}
        return {"weight": values, "weight_scale_inv": scale}, expected, settings
    scale = _scales((), torch.float32, generator)
    stored = {"weight": values, "weight_scale": scale, "input_scale": torch.tensor(1.0)}
    expected = values.to(torch.float32) * scale
    return stored, expected, {"quant_method": "fp8", "activation_scheme": "static"}


def _int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (in int64) as the int32 the files hold."""
    return (words - ((words >> 31) << 32)).to(torch.int32)


def save_all(root: Path) -> Path:
    """Every format's pair written under `root` (`<fmt>` and `<fmt>-float`)."""
    root.mkdir(parents=True, exist_ok=True)
    for fmt in FORMATS:
        save_pair(root, fmt)
    return root
