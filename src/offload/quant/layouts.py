"""Quantized weights laid out for the kernel that multiplies them, once, when the cache
entry is written, so that no forward has to re-arrange bytes (the disk tier streams the
laid-out bytes as they lie in the file).

- `q4`: GGUF's 4-bit types (Q4_0, Q4_1, Q4_K) as `d * q + m` for the CPU's integer
  products (`row_dot.q4_linear`, where it has AVX-512 VNNI): uint8 [out / 16, in / 32, 256],
  16 outputs' 32 values of a group two a byte, in the order `row_q4.c` reads them; scales
  and offsets [in / 32, out] exactly as the file gives them (float16 for Q4_0 and Q4_1,
  float32 for Q4_K's products of two scales). 4 bits a weight plus 1 (float16) or 2.
- `int4`: the same types in torch's CPU int4 packing (where the CPU lacks VNNI)
  (`_weight_int4pack_mm_for_cpu`): uint8 [out, in / 2] and, per group of 32 inputs, a
  bfloat16 scale and zero point ([in / 32, out, 2]), the value being (q - 8) * scale + zero.
  Same bits a weight as the file (4 + 32/32); the scales round from float16 to bfloat16.
  The packing depends on torch's build and the CPU's vector width, so the layout's name
  carries a fingerprint of it (`int4_cpu_layout`).
- `int4_cuda`: the same 4-bit types in torch's GPU int4 packing (`_weight_int4pack_mm`,
  tinygemm's tensor-core tiles: int32 [out / 8, in / (16 k), 32, k / 2] for k = 8, 4 or 2
  inner tiles) with the same bfloat16 scale and zero point; named by a fingerprint made
  on the GPU (`int4_cuda_layout`), and only where its probe reads back what it packed.
- `q8`: the types whose values fit int8 with a scale (and an offset) per group of g inputs
  (`gguf_quants.EIGHT_BIT_GROUPS`: Q8_0, Q5_0, Q5_1, Q5_K with g = 32, Q6_K with 16) as
  int8 [in / g, out, g] with their scales [in / g, out] (float16 where the file has them
  so, else float32) and offsets (Q5_1, Q5_K), so that one block column is one contiguous
  matrix. Q8_0 is its file's bytes split by column; the 5- and 6-bit types are widened to
  8 bits (1.5-1.8x their file's bytes, a third of float32's), since a product that unpacks
  their bits as it reads them ran slower than this one on the CPU (docs/benchmarks.md,
  "2026-11-28 (twenty-second session): the GGUF types users download, as llama.cpp makes
  them (issue 27)").
- anything else stays in GGUF's own blocks (`gguf_quants` de-quantizes them).

What each layout's module holds, how its tensors are made and which product reads them is
one table (`traits.LAYOUTS`); the products are `kernels.py`'s.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from offload.errors import ModelError
from offload.quant import row_dot
from offload.quant.gguf_quants import EIGHT_BIT_GROUPS, affine_4bit, affine_8bit
from offload.quant.kinds import QuantLayout

GROUP = 32  # inputs per scale, in both layouts
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


@functools.cache
def int4_cpu_layout() -> str | None:
    """The name of torch's CPU int4 packing here (a fingerprint of how it packs a fixed
    matrix), or None where this torch has no such kernel."""
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return None
    probe = (torch.arange(64 * 64, dtype=torch.int32) * 7 % 16).reshape(64, 64)
    packed = torch._convert_weight_to_int4pack_for_cpu(probe, 2)
    return "int4cpu-" + hashlib.sha256(packed.numpy().tobytes()).hexdigest()[:10]


@functools.cache
def _cuda_packing() -> tuple[str, bool] | None:
    """(fingerprint, high nibble first) of torch's GPU int4 packing here, or None where
    there is no usable one (no GPU, one older than sm_80, or a probe that does not read
    back the integers it packed in either nibble order)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8:
        return None
    probe = (torch.arange(64 * 128, dtype=torch.int32) * 7 % 16).reshape(64, 128)
    unit = torch.tensor([1.0, 8.0], dtype=torch.bfloat16).expand(128 // GROUP, 64, 2)
    eye = torch.eye(128, dtype=torch.bfloat16, device="cuda")
    for high_first in (True, False):
        try:
            packed = _pack_cuda(probe, high_first)
            back = torch.ops.aten._weight_int4pack_mm(eye, packed, GROUP, unit.contiguous().cuda())
        except (RuntimeError, AttributeError):
            return None
        if torch.equal(back.T.float().cpu(), probe.float()):
            digest = hashlib.sha256(packed.cpu().numpy().tobytes()).hexdigest()[:10]
            return "int4cuda-" + digest, high_first
    return None


def int4_cuda_layout() -> str | None:
    """The name of torch's GPU int4 packing here, or None where there is none."""
    packing = _cuda_packing()
    return packing[0] if packing else None


def packing_of(kernels: str) -> str | None:
    """The name of the 4-bit layout that `kernels` ("cpu", "cuda", "gguf") lay weights out
    in here (a converted folder's name carries it), or None (GGUF's blocks, or no such
    kernel)."""
    return {"cpu": _cpu_packing, "cuda": int4_cuda_layout}.get(kernels, lambda: None)()


Q4_NAME = "q4v1"  # (a new form of the q4 layout gets a new name: folders are converted anew)


def _cpu_packing() -> str | None:
    return Q4_NAME if row_dot.q4_fast() else int4_cpu_layout()


def inner_k_tiles(in_features: int) -> int:
    """The GPU packing's inner k-tiles for rows of `in_features` values (8, 4 or 2)."""
    return next(tiles for tiles in (8, 4, 2) if in_features % (tiles * 16) == 0)


def _pack_cuda(q: torch.Tensor, high_first: bool) -> torch.Tensor:
    """4-bit integers [out, in] (any integer dtype, on any device) -> the GPU packing, on
    the GPU: two values a byte, then tinygemm's tiles."""
    q = q.to(device="cuda", dtype=torch.uint8)
    first, second = q[:, ::2], q[:, 1::2]
    pairs = (first << 4 | second) if high_first else (second << 4 | first)
    return torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), inner_k_tiles(q.shape[1]))


def layout_for(type_name: str, name: str, kernels: str, rows: int = 8) -> QuantLayout:
    """The layout a weight of `rows` rows is kept in for `kernels` ("cpu", "cuda" or
    "gguf"): the embedding is looked up by row, so it stays in a layout rows can be read
    from (GGUF's or q8); the GPU's packing needs rows in whole tiles of 8."""
    four_bit = type_name in INT4_TYPES and "embed_tokens" not in name
    if kernels == "cpu" and type_name in EIGHT_BIT_GROUPS:
        return QuantLayout.Q8
    if kernels == "cpu" and four_bit and row_dot.q4_fast():
        return QuantLayout.Q4
    if kernels == "cpu" and four_bit and int4_cpu_layout() is not None:
        return QuantLayout.INT4
    if kernels == "cuda" and four_bit and rows % 8 == 0 and int4_cuda_layout() is not None:
        return QuantLayout.INT4_CUDA
    return QuantLayout.GGUF


@dataclass(frozen=True)
class Packing:
    """An int4 packing, which depends on the torch and device that made it: the settings key
    a converted folder names it by, its name here, and what makes it."""

    settings_key: str
    here: Callable[[], str | None]
    made_by: str


CPU_PACKING = Packing("int4_layout", int4_cpu_layout, "torch and CPU")
CUDA_PACKING = Packing("int4_cuda_layout", int4_cuda_layout, "torch and GPU")


def as_stored(raw: torch.Tensor, kind: str) -> tuple[torch.Tensor]:
    """GGUF's blocks: the weight's own bytes."""
    return (raw,)


def int4_cpu_tensors(raw: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit rows (uint8 [rows, bytes]) in the CPU's int4 packing: (packed, scale_zero)."""
    # In pieces of rows: the packing is local to blocks of 64 rows, so the bytes are
    # the same, and the widened copies (int32: 8x the stored bytes) stay small.
    pieces = [
        _int4(raw[at : at + _PIECE_ROWS], kind, None) for at in range(0, len(raw), _PIECE_ROWS)
    ]
    packed, scale_zero = torch.cat([p for p, _ in pieces]), torch.cat([z for _, z in pieces], 1)
    return packed, scale_zero.contiguous().cpu()


def int4_cuda_tensors(raw: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit rows in the GPU's int4 packing: (packed, scale_zero), on the CPU."""
    packing = _cuda_packing()
    assert packing is not None, "int4_cuda needs the GPU's packing"
    # (unpacked and packed on the GPU: a large model's in seconds)
    packed, scale_zero = _int4(raw.to("cuda"), kind, packing[1])
    return packed, scale_zero.contiguous().cpu()


_PIECE_ROWS = 1024  # rows laid out for the CPU's int4 kernel at a time (a multiple of 64)


def _int4(raw: torch.Tensor, kind: str, high_first: bool | None) -> tuple[torch.Tensor, ...]:
    """(packed, scale_zero [groups, rows, 2]) of 4-bit rows: for the CPU's kernel
    (`high_first` None) or the GPU's."""
    q, scale, offset = affine_4bit(raw, kind)
    if high_first is None:
        packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
    else:
        packed = _pack_cuda(q, high_first).cpu()
    zero = offset + 8 * scale  # (q - 8) * scale + zero == scale * q + offset
    return packed, torch.stack([scale, zero], dim=-1).transpose(0, 1).to(torch.bfloat16)


def q4_scale_dtype(kind: str) -> torch.dtype:
    """The dtype of a q4 weight's scales and offsets: the file's float16 where a group's
    scale is one float16 (Q4_0's offset, -8 d, is one too), float32 for Q4_K's products."""
    return torch.float32 if kind == "Q4_K" else torch.float16


def q4_tensors(raw: torch.Tensor, kind: str) -> tuple[torch.Tensor, ...]:
    """4-bit rows (uint8 [rows, bytes]) in the q4 layout: (nibbles, scales, offsets)."""
    dtype = q4_scale_dtype(kind)
    pieces = [
        _q4(raw[at : at + _PIECE_ROWS], kind, dtype) for at in range(0, len(raw), _PIECE_ROWS)
    ]
    nibbles = torch.cat([p[0] for p in pieces])
    scales, offsets = (torch.cat([p[i] for p in pieces], 1).contiguous() for i in (1, 2))
    return nibbles, scales, offsets


def _q4(raw: torch.Tensor, kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    q, scale, offset = affine_4bit(raw, kind)
    rows, values = q.shape
    padded = torch.zeros((rows + 15) // 16 * 16, values, dtype=torch.uint8)
    padded[:rows] = q
    # value k = 32 g + 8 p + 4 h + i of output 16 t + n -> byte [t, g, p, n, i], half h
    v = padded.reshape(-1, 16, values // GROUP, 4, 2, 4)
    nibbles = (v[..., 0, :] | v[..., 1, :] << 4).permute(0, 2, 3, 1, 4)
    exact = [t.to(dtype) for t in (scale, offset)]
    kept = (
        torch.allclose(t.float(), f, rtol=0, atol=0, equal_nan=True)
        for t, f in zip(exact, (scale, offset), strict=True)
    )
    if not all(kept):  # (Q4_0's -8 d past float16's range: no file has such scales)
        raise ModelError(
            f"a {kind} weight's scales do not fit {dtype} (the q4 layout keeps them so)"
        )
    return nibbles.reshape(-1, values // GROUP, 256), *(t.T for t in exact)


def q4_values(nibbles: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The float32 values [out, in] of a q4 weight (`d * q + m`)."""
    tiles, groups, _ = nibbles.shape
    pairs = nibbles.reshape(tiles, groups, 4, 16, 4)
    q = torch.stack([pairs & 15, pairs >> 4], dim=3)  # [t, g, p, h, n, i]
    q = q.permute(0, 4, 1, 2, 3, 5).reshape(tiles * 16, groups, GROUP)[: scales.shape[1]]
    return (q.float() * scales.T.float()[..., None] + offsets.T.float()[..., None]).flatten(1)


def pack_q8(raw: torch.Tensor, kind: str = "Q8_0") -> tuple[torch.Tensor, ...]:
    """Rows of a type that fits 8 bits (uint8 [out, bytes]) -> (int8 [in / g, out, g],
    scales [in / g, out], offsets [in / g, out] or None)."""
    group = EIGHT_BIT_GROUPS[kind][0]
    q, scale, offset = affine_8bit(raw, kind)
    values = q.reshape(raw.shape[0], -1, group).transpose(0, 1).contiguous()
    columns = [scale.T.contiguous(), None if offset is None else offset.T.contiguous()]
    return values, *columns


def q8_values(
    values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None = None
) -> torch.Tensor:
    """The float32 values of q8 block columns (int8 [blocks, rows, g], scales and offsets
    [blocks, rows]) as [rows, blocks * g]: `q * d (+ m)` as the reference computes it, bit
    for bit."""
    floats = values.float() * scales.float().unsqueeze(-1)
    if offsets is not None:
        floats = floats + offsets.float().unsqueeze(-1)
    return floats.movedim(0, -2).flatten(-2)
