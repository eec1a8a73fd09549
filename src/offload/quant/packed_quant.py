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

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from offload.offloader.ops import define_op
from offload.quant import row_dot
from offload.quant.kinds import PackedKind

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column each nibble of an AWQ word holds
_NIBBLES = 0x0F0F0F0F0F0F0F0F


def unpack_words(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 words along the last dimension, 32 / bits values each, the first in the lowest
    bits -> uint8 [..., count] of values in [0, 2^bits). 4 and 8 bits read the words'
    bytes (a little-endian word's first byte holds its lowest bits), others shift."""
    if bits == 8 and sys.byteorder == "little":
        return words.contiguous().view(torch.uint8)[..., :count]
    if bits == 4 and sys.byteorder == "little":  # each nibble spread to a byte of an int64
        spread = words.contiguous().to(torch.int64) & 0xFFFFFFFF
        for shift, mask in ((16, 0x0000FFFF0000FFFF), (8, 0x00FF00FF00FF00FF), (4, _NIBBLES)):
            spread = (spread | (spread << shift)) & mask
        return spread.view(torch.uint8)[..., :count]
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    values = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.flatten(-2)[..., :count].to(torch.uint8)


def dequantize_packed(form: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The weight [out, in] that `tensors` (the module's, in `used_tensors(form)`'s order)
    hold in `form` ("kind:setting:...", as `model/packed_forms.py` names it)."""
    return _traits(form).dequantize(tensors, form.split(":")[1:])


def _traits(form: str) -> PackedTraits:
    traits = PACKED.get(form.split(":")[0])
    if traits is None:
        raise ValueError(f"unknown packed form {form!r}")
    return traits


def _ct_packed(tensors: list[torch.Tensor], settings: list[str]) -> torch.Tensor:
    packed, scale, *zero = tensors
    bits = int(settings[0])
    q = unpack_words(packed, bits, packed.shape[1] * 32 // bits)
    offset = 1 << (bits - 1)  # (stored plus 2^(bits-1), zero points too)
    zero_point = unpack_words(zero[0].T, bits, packed.shape[0]).T if zero else None
    return _affine(q, scale, offset, zero_point, offset)


def _ct_plain(tensors: list[torch.Tensor], settings: list[str]) -> torch.Tensor:
    weight, scale, *zero = tensors
    return _affine(weight, scale, 0, zero[0] if zero else None, 0)


def _gptq_of(tensors: list[torch.Tensor], settings: list[str]) -> torch.Tensor:
    return _gptq(tensors, int(settings[0]), settings[1] == "v1", "act" in settings)


def _awq(tensors: list[torch.Tensor], settings: list[str]) -> torch.Tensor:
    qweight, qzeros, scales = tensors
    q = _awq_columns(qweight).T  # [out, in]
    return _affine(q, scales.T, 0, _awq_columns(qzeros).T, 0)


def _fp8_of(tensors: list[torch.Tensor], settings: list[str]) -> torch.Tensor:
    weight, scale = tensors[:2]
    block = [int(size) for size in settings] if settings else None
    return _fp8(weight, scale, block)


def _affine(
    q: torch.Tensor,
    scale: torch.Tensor,
    offset: int,
    zero: torch.Tensor | None,
    zero_offset: int,
) -> torch.Tensor:
    """(q - offset - (zero - zero_offset)) * scale in the scale's dtype, for integers q
    [out, in] with a scale (and zero point) per group of inputs: [out, groups], [out, 1]
    (per row) or [1] / [] (one). Computed in float32 and rounded once to the scale's dtype:
    the difference is a small integer and its product with a 16-bit scale is exact in
    float32, so the bits are those of the product in the scale's dtype (as the formats'
    own code computes it), at float32's speed on a CPU."""
    scale = scale.reshape(-1, 1) if scale.dim() < 2 else scale
    values = q.unflatten(-1, (scale.shape[-1], -1)).to(torch.float32)
    shift = scale.new_full((), offset, dtype=torch.float32)
    if zero is not None:
        zero = zero.reshape(-1, 1) if zero.dim() < 2 else zero
        shift = (zero.to(torch.float32) + (offset - zero_offset)).unsqueeze(-1)
    if offset or zero is not None:
        values.sub_(shift)  # (in place: each temporary of a weight's size costs page faults)
    values.mul_(scale.to(torch.float32).unsqueeze(-1))
    return values.flatten(-2).to(scale.dtype)


def _gptq(tensors: list[torch.Tensor], bits: int, v1: bool, act_order: bool) -> torch.Tensor:
    """GPTQ's weight [out, in]: groups in input order, or with act-order by `g_idx`."""
    qweight, qzeros, scales, *g_idx = tensors
    rows_in, rows_out = qweight.shape[0] * 32 // bits, qweight.shape[1]
    q = unpack_words(qweight.T, bits, rows_in)  # [out, in]
    zero = unpack_words(qzeros, bits, rows_out)  # [groups, out]
    if v1:  # (v1 stores zero - 1; AutoGPTQ adds the 1 back within the bits)
        zero = (zero + 1) & ((1 << bits) - 1)
    if act_order and g_idx:
        group = g_idx[0].long()
        values = q.to(torch.float32).sub_(zero[group].T)
        return values.mul_(scales[group].T).to(scales.dtype)
    return _affine(q, scales.T, 0, zero.T, 0)


def _awq_columns(words: torch.Tensor) -> torch.Tensor:
    """AWQ's words [rows, columns / 8] -> uint8 [rows, columns] in column order."""
    nibbles = unpack_words(words, 4, words.shape[1] * 8).unflatten(-1, (-1, 2, 4))
    # Column c of a word sits at nibble AWQ_ORDER.index(c) = c // 2 + 4 * (c % 2): the
    # word's two halves interleaved, a transpose (an index list would be copied to the
    # device, which a CUDA graph's capture refuses).
    return nibbles.transpose(-1, -2).flatten(-3)


def _fp8(weight: torch.Tensor, scale: torch.Tensor, block: list[int] | None) -> torch.Tensor:
    values, scale = _fp8_floats(weight), scale.to(torch.float32) * _FP8_UNIT
    if block is not None:  # one scale per block of block[0] x block[1] values
        rows, columns = weight.shape
        scale = scale.repeat_interleave(block[0], 0)[:rows]
        scale = scale.repeat_interleave(block[1], 1)[:, :columns]
    elif scale.dim() == 2 and scale.shape[1] > 1:  # per group of inputs
        return values.unflatten(-1, (scale.shape[1], -1)).mul_(scale.unsqueeze(-1)).flatten(-2)
    elif scale.numel() > 1:
        scale = scale.reshape(-1, 1)  # per row
    return values.mul_(scale)


_FP8_UNIT = 256.0  # an E4M3 code read as float16 bits (below) is its value / 256


def _fp8_floats(weight: torch.Tensor) -> torch.Tensor:
    """float8 E4M3 values / 256, as float32. The code's sign, exponent and mantissa moved
    into a float16's places give value * 2^-8 exactly (normal and subnormal alike: the
    exponent biases differ by 8), and float16 -> float32 is a fast vector conversion where
    torch converts float8 element by element (much slower on a CPU: docs/benchmarks.md).
    Times a scale made 256 times larger, each product is the same real number rounded
    once: the same bits. (The NaN code reads as 1.875; a checkpoint's weights hold none.)"""
    if weight.device.type == "meta":
        return weight.to(torch.float32)
    code = weight.view(torch.uint8).to(torch.int16)
    half = ((code & 0x80) << 8) | ((code & 0x7F) << 7)
    return half.view(torch.float16).to(torch.float32)


def out_features(form: str, tensors: list[torch.Tensor]) -> int:
    """The rows of the weight `tensors` hold in `form` (from their shapes alone)."""
    return _traits(form).rows(tensors)


@dataclass(frozen=True)
class PackedTraits:
    """What a packed layer of one kind is: the tensors its de-quantization takes, in its
    order (a tuple names alternatives: the first the layer has), the de-quantization
    (tensors, the form's settings -> the weight [out, in]), and its rows by their shapes."""

    tensors: tuple[str | tuple[str, ...], ...]
    dequantize: Callable[[list[torch.Tensor], list[str]], torch.Tensor]
    rows: Callable[[list[torch.Tensor]], int]


def _rows_first(tensors: list[torch.Tensor]) -> int:
    return tensors[0].shape[0]


PACKED: dict[PackedKind, PackedTraits] = {
    PackedKind.CT_PACKED: PackedTraits(
        ("weight_packed", "weight_scale", "weight_zero_point"), _ct_packed, _rows_first
    ),
    PackedKind.CT_PLAIN: PackedTraits(
        ("weight", "weight_scale", "weight_zero_point"), _ct_plain, _rows_first
    ),
    PackedKind.GPTQ: PackedTraits(
        ("qweight", "qzeros", "scales", "g_idx"), _gptq_of, lambda t: t[0].shape[1]
    ),
    PackedKind.AWQ: PackedTraits(
        ("qweight", "qzeros", "scales"), _awq, lambda t: t[0].shape[1] * 8
    ),
    PackedKind.FP8: PackedTraits(
        ("weight", ("weight_scale_inv", "weight_scale")), _fp8_of, _rows_first
    ),
}


def used_tensors(form: str, names: Iterable[str]) -> list[str]:
    """The tensors of `names` (a layer's) that `dequantize_packed` takes for `form`, in
    its order."""
    held, used = set(names), []
    for entry in _traits(form).tensors:
        options = (entry,) if isinstance(entry, str) else entry
        used += [name for name in options if name in held][:1]
    return used


def packed_linear(
    x: torch.Tensor, tensors: list[torch.Tensor], form: str, bias: torch.Tensor | None
) -> torch.Tensor:
    """`F.linear` with the weight `tensors` hold in `form`, in x's dtype (under
    torch.compile it runs as the opaque op below: `kernels.stored_op`)."""
    weight = dequantize_packed(form, tensors).to(x.dtype)
    return torch.nn.functional.linear(x, weight, None if bias is None else bias.to(x.dtype))


def _packed_step_linear(
    x: torch.Tensor, tensors: list[torch.Tensor], form: str, bias: torch.Tensor | None
) -> torch.Tensor:
    """`packed_linear` in a compiled step: its product as the eager decode step's
    (`row_dot.step_linear`)."""
    weight = dequantize_packed(form, tensors).to(x.dtype)
    return row_dot.step_linear(x, weight, None if bias is None else bias.to(x.dtype))


def _packed_fake(
    x: torch.Tensor, tensors: list[torch.Tensor], form: str, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features(form, tensors))


# (opaque under torch.compile, as the other stored products: see `kernels.stored_op`)
packed_linear_op = define_op(
    "packed_linear",
    "(Tensor x, Tensor[] tensors, str form, Tensor? bias) -> Tensor",
    _packed_step_linear,
    _packed_fake,
)
