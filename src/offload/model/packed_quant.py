"""The quantized safetensors formats vLLM loads, de-quantized with torch: a module's stored
tensors -> its weight [out, in], bit for bit what each format's own code computes.

- `ct_packed`: compressed-tensors `pack-quantized` (llm-compressor's W4A16 / W8A16):
  `weight_packed` int32 [out, in * bits / 32], value i of a row in bits [bits * i % 32, ...)
  of word bits * i // 32, stored plus 2^(bits-1); `weight_scale` [out, groups] (one group
  per row: channel); asymmetric ones add `weight_zero_point` packed the same way along
  the output rows. Value: (q - zero) * scale in the scale's dtype (compressed-tensors'
  `dequantize`).
- `ct_plain`: compressed-tensors `int-quantized` / `naive-quantized` (`weight` int8
  [out, in]) and `float-quantized` (float8 E4M3) with the same scales (and zero points),
  unpacked; computed as above, in the scale's dtype.
- `gptq`: AutoGPTQ / GPTQModel: `qweight` int32 [in * bits / 32, out] packed along the
  inputs, `qzeros` int32 [groups, out * bits / 32] along the outputs (format v1 stores
  zero - 1), `scales` float16 [groups, out], `g_idx` int32 [in] (the group of each input:
  act-order checkpoints permute it). Value: scales[g] * (q - zero[g]) in float16.
- `awq`: AutoAWQ's GEMM format: `qweight` int32 [in, out / 8] and `qzeros` int32
  [groups, out / 8], each word's 8 nibbles holding the columns in the order 0 2 4 6 1 3 5 7,
  `scales` float16 [groups, out]. Value: (q - zero) * scale in float16.
- `fp8`: float8 E4M3 `weight` [out, in] times a float32 scale: one (per tensor), one per
  row, or one per block of the `weight_block_size` ([128, 128]: `weight_scale_inv`), in
  float32 (transformers' `Fp8Dequantize` and vLLM's).

Activations are not quantized: W8A8 checkpoints run with their weights de-quantized.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column each nibble of an AWQ word holds
_AWQ_UNDO = tuple(AWQ_ORDER.index(column) for column in range(8))  # nibble of each column
KINDS = ("ct_packed", "ct_plain", "gptq", "awq", "fp8")


def unpack_words(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 words along the last dimension, 32 / bits values each, the first in the lowest
    bits -> int32 [..., count] of values in [0, 2^bits)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    values = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.flatten(-2)[..., :count]


def dequantize_packed(form: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The weight [out, in] that `tensors` (the module's, in `tensor_names(form)`'s order)
    hold in `form` ("kind:setting:..."; see `forms`)."""
    kind, *settings = form.split(":")
    if kind == "ct_packed":
        packed, scale, *zero = tensors
        bits = int(settings[0])
        q = unpack_words(packed, bits, packed.shape[1] * 32 // bits) - (1 << (bits - 1))
        zero_point = None
        if zero:
            zero_point = unpack_words(zero[0].T, bits, packed.shape[0]).T - (1 << (bits - 1))
        return _grouped(q, scale, zero_point)
    if kind == "ct_plain":
        weight, scale, *zero = tensors
        return _grouped(weight, scale, zero[0] if zero else None)
    if kind == "gptq":
        return _gptq(tensors, int(settings[0]), settings[1] == "v1")
    if kind == "awq":
        qweight, qzeros, scales = tensors
        q = _awq_columns(qweight)  # [in, out]
        zero = _awq_columns(qzeros).repeat_interleave(q.shape[0] // qzeros.shape[0], 0)
        scale = scales.repeat_interleave(q.shape[0] // scales.shape[0], 0)
        return ((q - zero).to(scales.dtype) * scale).T
    if kind == "fp8":
        weight, scale = tensors[:2]
        block = [int(size) for size in settings] if settings else None
        return _fp8(weight, scale, block)
    raise ValueError(f"unknown packed form {form!r}")


def _grouped(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """compressed-tensors' de-quantization of integers q [out, in] with a scale (and zero
    point) per group of inputs: [out, groups], [out, 1] (channel) or [1] / [] (tensor)."""
    scale = scale.reshape(-1, 1) if scale.dim() < 2 else scale
    groups = scale.shape[-1]
    values = q.unflatten(-1, (groups, -1)).to(scale.dtype)
    if zero is not None:
        zero = zero.reshape(-1, 1) if zero.dim() < 2 else zero
        values = values - zero.to(scale.dtype).unsqueeze(-1)
    return (values * scale.unsqueeze(-1)).flatten(-2)


def _gptq(tensors: list[torch.Tensor], bits: int, v1: bool) -> torch.Tensor:
    qweight, qzeros, scales, *g_idx = tensors
    rows_in, rows_out = qweight.shape[0] * 32 // bits, qweight.shape[1]
    q = unpack_words(qweight.T, bits, rows_in)  # [out, in]
    zero = unpack_words(qzeros, bits, rows_out)  # [groups, out]
    if v1:  # (v1 stores zero - 1; AutoGPTQ adds the 1 back within the bits)
        zero = (zero + 1) & ((1 << bits) - 1)
    if g_idx:
        group = g_idx[0].long()
    else:
        group = torch.arange(rows_in, device=q.device) // (rows_in // scales.shape[0])
    return (q - zero[group].T).to(scales.dtype) * scales[group].T


def _awq_columns(words: torch.Tensor) -> torch.Tensor:
    """AWQ's words [rows, columns / 8] -> int32 [rows, columns] in column order."""
    nibbles = unpack_words(words, 4, words.shape[1] * 8).unflatten(-1, (-1, 8))
    return nibbles[..., list(_AWQ_UNDO)].flatten(-2)


def _fp8(weight: torch.Tensor, scale: torch.Tensor, block: list[int] | None) -> torch.Tensor:
    values = weight.to(torch.float32)
    scale = scale.to(torch.float32)
    if block is not None:  # one scale per block of block[0] x block[1] values
        rows, columns = weight.shape
        scale = scale.repeat_interleave(block[0], 0)[:rows]
        scale = scale.repeat_interleave(block[1], 1)[:, :columns]
    elif scale.dim() == 2 and scale.shape[1] > 1:  # per group of inputs
        return (values.unflatten(-1, (scale.shape[1], -1)) * scale.unsqueeze(-1)).flatten(-2)
    elif scale.numel() > 1:
        scale = scale.reshape(-1, 1)  # per row
    return values * scale


def out_features(form: str, tensors: list[torch.Tensor]) -> int:
    """The rows of the weight `tensors` hold in `form` (from their shapes alone)."""
    kind = form.split(":")[0]
    if kind == "gptq":
        return tensors[0].shape[1]
    if kind == "awq":
        return tensors[0].shape[1] * 8
    return tensors[0].shape[0]


def packed_linear(
    x: torch.Tensor, tensors: list[torch.Tensor], form: str, bias: torch.Tensor | None
) -> torch.Tensor:
    """`F.linear` with the weight `tensors` hold in `form`, in x's dtype; under
    torch.compile one opaque op (as `quant_layouts.stored_op`'s): a compiled model gives
    the bits an eager one gives, wherever its weights came from."""
    if torch.compiler.is_compiling():
        return _packed_linear_op(x, tensors, form, bias)
    return _packed_linear(x, tensors, form, bias)


def _packed_linear(
    x: torch.Tensor, tensors: list[torch.Tensor], form: str, bias: torch.Tensor | None
) -> torch.Tensor:
    weight = dequantize_packed(form, tensors).to(x.dtype)
    return torch.nn.functional.linear(x, weight, None if bias is None else bias.to(x.dtype))


@torch.library.custom_op("offload::packed_linear", mutates_args=())
def _packed_linear_op(
    x: torch.Tensor, tensors: list[torch.Tensor], form: str, bias: torch.Tensor | None
) -> torch.Tensor:
    return _packed_linear(x, tensors, form, bias)


@_packed_linear_op.register_fake
def _(x: torch.Tensor, tensors: list[torch.Tensor], form: str, bias: torch.Tensor | None):
    return x.new_empty(*x.shape[:-1], out_features(form, tensors))
