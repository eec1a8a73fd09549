"""GGUF's quantized blocks, read with torch: a tensor's stored bytes -> its float32 values,
bit for bit what the `gguf` package's reference (`gguf.quants.dequantize`) gives, and so
what transformers loads from a GGUF file today.

A quantized tensor is a run of blocks; each block holds `block_size` values in
`block_bytes` bytes: fp16 scales (and minimums) and packed integers. The arithmetic is
done in the reference's order, one rounding per operation (`d * q + m`, never fused), so
the results are equal, not close. Only the layout is shared with llama.cpp and `gguf`;
the code is written from the format.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from offload.errors import ModelError

QK_K = 256  # values in a K-quant super-block


@dataclass(frozen=True)
class BlockFormat:
    block_size: int  # values per block
    block_bytes: int  # bytes per block


FORMATS = {
    "Q4_0": BlockFormat(32, 18),
    "Q4_1": BlockFormat(32, 20),
    "Q5_0": BlockFormat(32, 22),
    "Q5_1": BlockFormat(32, 24),
    "Q8_0": BlockFormat(32, 34),
    "Q2_K": BlockFormat(QK_K, 84),
    "Q3_K": BlockFormat(QK_K, 110),
    "Q4_K": BlockFormat(QK_K, 144),
    "Q5_K": BlockFormat(QK_K, 176),
    "Q6_K": BlockFormat(QK_K, 210),
}

# The byte of each fp16 scale (and minimum) in a block of each format.
SCALES_AT = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}  # fmt: skip


def dequantize(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """The float32 values of `raw` (uint8 [..., bytes per row]) stored as GGUF type
    `type_name`: [..., values per row]."""
    if type_name == "F32":
        return raw.contiguous().view(torch.float32)
    if type_name == "F16":
        return raw.contiguous().view(torch.float16).float()
    if type_name not in FORMATS:
        allowed = ", ".join(["F32", "F16", *FORMATS])
        raise ModelError(f"GGUF type {type_name} is not read yet; these are: {allowed}")
    block = FORMATS[type_name]
    if raw.dtype != torch.uint8 or raw.shape[-1] % block.block_bytes:
        raise ModelError(
            f"a {type_name} row must be whole blocks of {block.block_bytes} bytes; "
            f"got {raw.shape[-1]} bytes of {raw.dtype}"
        )
    rows = raw.shape[:-1]
    blocks = raw.reshape(-1, block.block_bytes)  # [blocks, bytes]
    values = _DECODERS[type_name](blocks)  # [blocks, block_size]
    return values.reshape(*rows, -1)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of each block: [blocks, 1] (float16)."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of each block, as float32: [blocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor, group: int) -> torch.Tensor:
    """Each run of `group` bytes gives `group` low nibbles, then `group` high ones:
    [blocks, bytes] -> [blocks, 2 * bytes] (uint8, 0..15)."""
    num = packed.shape[0]
    runs = packed.reshape(num, -1, 1, group)
    return torch.cat([runs & 0x0F, runs >> 4], dim=2).reshape(num, -1)


def _bits(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Little-endian fields of `width` bits, lowest first, from each byte:
    [blocks, bytes] -> [blocks, bytes * 8 / width] in byte-major order."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=packed.device)
    mask = (1 << width) - 1
    return ((packed[:, :, None] >> shifts) & mask).reshape(packed.shape[0], -1)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:], 16).to(torch.int8) - 8
    return d * q.float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 4:], 16).float()
    return (d * q) + m


def _five_bit(blocks: torch.Tensor, high_at: int) -> torch.Tensor:
    """Q5_0/Q5_1's 32 values 0..31: nibbles after the 4 high-bit bytes at `high_at`."""
    high = _bits(blocks[:, high_at : high_at + 4], 1)  # bit i of the uint32: value i's
    low = _nibbles(blocks[:, high_at + 4 :], 16)
    return low | (high << 4)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = _five_bit(blocks, 2).to(torch.int8) - 16
    return d * q.float()


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _five_bit(blocks, 4).float()
    return (d * q) + m


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return q * d


def _runs(packed: torch.Tensor, width: int = 2, run: int = 32) -> torch.Tensor:
    """Q2_K/Q3_K's fields of `width` bits in runs of `run` bytes: each run gives 8 / width
    groups of `run` values, the lowest bits first: [blocks, bytes] -> [blocks, 8 * bytes /
    width] (uint8). (Shifts made on the device: see `_q6_k`.)"""
    num = packed.shape[0]
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=packed.device)
    fields = packed.reshape(num, -1, 1, run) >> shifts.reshape(1, 1, -1, 1)
    return (fields & ((1 << width) - 1)).reshape(num, -1)


def _q2_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q2_K as (q 0..3 [blocks, 256], scale and minimum [blocks, 16]) per group of 16:
    value = scale * q - minimum, 4-bit scales and minimums times d and dmin."""
    scales, d, dmin = blocks[:, :16], _f16(blocks, 80), _f16(blocks, 82)
    q = _runs(blocks[:, 16:80])
    return q, d * (scales & 0x0F).float(), dmin * (scales >> 4).float()


def _q3_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q3_K as (q -4..3 int8 [blocks, 256], scale [blocks, 16]) per group of 16: two low
    bits from the 64 bytes after the 32-byte high-bit mask, the value less 4 where its
    mask bit is clear; 6-bit scales (less 32) from 12 bytes, times d."""
    low = _runs(blocks[:, 32:96]).to(torch.int8)
    clear = (_runs(blocks[:, :32], 1) ^ 1).to(torch.int8)
    packed = blocks[:, 96:108]
    lows = torch.cat([packed[:, :8] & 0x0F, packed[:, :8] >> 4], dim=1)  # [blocks, 16]
    highs = _runs(packed[:, 8:12], run=4)
    sixes = (lows | (highs << 4)).to(torch.int8) - 32
    return low - (clear << 2), _f16(blocks, 108) * sixes.float()


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    num = blocks.shape[0]
    q, scale, low = _q2_k_parts(blocks)
    values = scale.reshape(num, 16, 1) * q.reshape(num, 16, 16).float() - low.reshape(num, 16, 1)
    return values.reshape(num, QK_K)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    num = blocks.shape[0]
    q, scale = _q3_k_parts(blocks)
    return (scale.reshape(num, 16, 1) * q.reshape(num, 16, 16).float()).reshape(num, QK_K)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 8 six-bit scales and 8 six-bit minimums from 12 bytes: bytes 0-3 hold
    scales 0-3 (and the top bits of scales 4-7), 4-7 the minimums 0-3 (and the top bits
    of minimums 4-7), 8-11 the low nibbles of scales (low) and minimums (high) 4-7."""
    d, m, both = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([d & 0x3F, (both & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mins = torch.cat([m & 0x3F, (both >> 4) | ((m >> 2) & 0x30)], dim=1)
    return scales, mins  # [blocks, 8] each


def _k_affine(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: value = d * scale_j * q - dmin * min_j over 8 groups of 32."""
    num = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scales, mins = _k_scales(blocks[:, 4:16])
    step = (d * scales.float()).reshape(num, -1, 1)
    low = (dmin * mins.float()).reshape(num, -1, 1)
    return (step * q.reshape(num, -1, 32).float() - low).reshape(num, QK_K)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    return _k_affine(blocks, _nibbles(blocks[:, 16:], 32))


def _q5_k_values(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K's 256 values 0..31 (uint8 [blocks, 8, 32])."""
    num = blocks.shape[0]
    low = _nibbles(blocks[:, 48:], 32).reshape(num, 8, 32)
    # Bit j of high byte i is the fifth bit of value i of group j.
    high = _bits(blocks[:, 16:48], 1).reshape(num, 32, 8).transpose(1, 2)
    return low | (high << 4)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    return _k_affine(blocks, _q5_k_values(blocks))


def _q6_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K as (q -32..31 int8 [blocks, 256], scale [blocks, 16]) per group of 16: the
    int8 scales times d."""
    num = blocks.shape[0]
    low = _nibbles(blocks[:, :128], 64).reshape(num, 8, 32)
    # Each run of 32 high bytes gives 2-bit fields for 4 groups: bits 0-1 the first, ...
    high = _runs(blocks[:, 128:192]).reshape(num, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(num, QK_K)
    return q, _f16(blocks, 208) * blocks[:, 192:208].contiguous().view(torch.int8).float()


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    num = blocks.shape[0]
    q, scale = _q6_k_parts(blocks)
    return (scale.reshape(num, 16, 1) * q.reshape(num, 16, 16).float()).reshape(num, QK_K)


def affine_4bit(raw: torch.Tensor, type_name: str) -> tuple[torch.Tensor, ...]:
    """A 4-bit type's rows as (q, scale, offset): uint8 q [rows, values] in 0..15 and
    float32 [rows, values / 32] per group of 32, so that a value is `scale * q + offset`
    (the reference's order for Q4_1 and Q4_K; for Q4_0 `d * (q - 8)` is `d * q - 8 * d`
    only up to rounding)."""
    block = FORMATS[type_name]
    rows = raw.shape[:-1]
    blocks = raw.reshape(-1, block.block_bytes)
    if type_name == "Q4_K":
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        scales, mins = _k_scales(blocks[:, 4:16])
        q, scale, offset = _nibbles(blocks[:, 16:], 32), d * scales.float(), -(dmin * mins.float())
    elif type_name == "Q4_1":
        q, scale, offset = _nibbles(blocks[:, 4:], 16), _f16(blocks, 0), _f16(blocks, 2)
    elif type_name == "Q4_0":
        d = _f16(blocks, 0)
        q, scale, offset = _nibbles(blocks[:, 2:], 16), d, -8 * d
    else:
        raise ModelError(f"GGUF type {type_name} is not a 4-bit type (Q4_0, Q4_1, Q4_K)")
    return q.reshape(*rows, -1), scale.reshape(*rows, -1), offset.reshape(*rows, -1)


# The types whose values fit int8 with a scale (and an offset) per group of inputs:
# (inputs per group, whether a group has an offset). `affine_8bit` reads them.
EIGHT_BIT_GROUPS = {
    "Q8_0": (32, False),
    "Q5_0": (32, False),
    "Q5_1": (32, True),
    "Q5_K": (32, True),
    "Q6_K": (16, False),
}


def affine_8bit(raw: torch.Tensor, type_name: str) -> tuple[torch.Tensor, ...]:
    """A type of `EIGHT_BIT_GROUPS` as (q, scale, offset or None): int8 q [rows, values]
    and, per group of inputs, a scale and an offset [rows, groups] (float16 where the file
    holds them so, else the float32 products the reference computes), so that
    `q.float() * scale.float() + offset.float()` is bit for bit the reference's value (its
    `d * q - m` is `q * d + (-m)` exactly: one rounding each)."""
    if type_name not in EIGHT_BIT_GROUPS:
        raise ModelError(
            f"GGUF type {type_name} does not fit 8 bits a value; these do: "
            f"{', '.join(EIGHT_BIT_GROUPS)}"
        )
    block = FORMATS[type_name]
    rows = raw.shape[:-1]
    blocks = raw.reshape(-1, block.block_bytes)
    num, offset = blocks.shape[0], None
    if type_name == "Q8_0":
        q, scale = blocks[:, 2:].contiguous().view(torch.int8), _half(blocks, 0)
    elif type_name == "Q5_0":
        q, scale = _five_bit(blocks, 2).to(torch.int8) - 16, _half(blocks, 0)
    elif type_name == "Q5_1":
        q = _five_bit(blocks, 4).to(torch.int8)
        scale, offset = _half(blocks, 0), _half(blocks, 2)
    elif type_name == "Q5_K":
        q = _q5_k_values(blocks).reshape(num, QK_K).to(torch.int8)
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        scales, mins = _k_scales(blocks[:, 4:16])
        scale, offset = d * scales.float(), -(dmin * mins.float())
    else:
        q, scale = _q6_k_parts(blocks)
    if offset is not None:
        offset = offset.reshape(*rows, -1)
    return q.reshape(*rows, -1), scale.reshape(*rows, -1), offset


_DECODERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
