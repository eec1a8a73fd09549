"""Quantized weights laid out for the kernel that multiplies them, once, when the cache
entry is written, so that no forward has to re-arrange bytes (the disk tier streams the
laid-out bytes as they lie in the file).

- `int4`: GGUF's 4-bit types (Q4_0, Q4_1, Q4_K) in torch's CPU int4 packing
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
  their bits as it reads them ran 2x slower than this one on the CPU (docs/benchmarks.md).
- anything else stays in GGUF's own blocks (`gguf_quants` de-quantizes them).
"""

from __future__ import annotations

import functools
import hashlib

import torch
import torch.nn.functional as F

from offload.offloader.ops import define_op
from offload.quant.gguf_quants import (
    EIGHT_BIT_GROUPS,
    FORMATS,
    affine_4bit,
    affine_8bit,
    dequantize,
)
from offload.quant.packed_quant import packed_linear, packed_linear_op

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
    """The name of the int4 packing that `kernels` ("cpu", "cuda", "gguf") lay weights out
    in here, or None (GGUF's blocks, or no such kernel)."""
    return {"cpu": int4_cpu_layout, "cuda": int4_cuda_layout}.get(kernels, lambda: None)()


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


def layout_for(type_name: str, name: str, kernels: str, rows: int = 8) -> str:
    """The layout a weight of `rows` rows is kept in for `kernels` ("cpu", "cuda" or
    "gguf"): the embedding is looked up by row, so it stays in a layout rows can be read
    from (GGUF's or q8); the GPU's packing needs rows in whole tiles of 8."""
    four_bit = type_name in INT4_TYPES and "embed_tokens" not in name
    if kernels == "cpu" and type_name in EIGHT_BIT_GROUPS:
        return "q8"
    if kernels == "cpu" and four_bit and int4_cpu_layout() is not None:
        return "int4"
    if kernels == "cuda" and four_bit and rows % 8 == 0 and int4_cuda_layout() is not None:
        return "int4_cuda"
    return "gguf"


def stored_settings(types: dict[str, str], layouts: dict[str, str]) -> dict[str, object]:
    """The `quantization_config` of weights of GGUF `types` kept in `layouts` (each
    packing named by the fingerprint of the torch and device that made it)."""
    settings: dict[str, object] = {"quant_method": "gguf", "weight_types": types}
    if layouts:
        settings["weight_layouts"] = layouts
    if "int4" in layouts.values():
        settings["int4_layout"] = int4_cpu_layout()
    if "int4_cuda" in layouts.values():
        settings["int4_cuda_layout"] = int4_cuda_layout()
    return settings


def laid_out(name: str, raw: torch.Tensor, kind: str, layout: str) -> dict[str, torch.Tensor]:
    """The tensors of one GGUF weight (uint8 [rows, bytes]) in `layout`, by the names of
    the module's parameters: `weight`, and `scale_zero` or `scales`."""
    if layout == "gguf":
        return {name: raw}
    stem = name.removesuffix(".weight")
    if layout == "q8":
        values, scales, offsets = pack_q8(raw, kind)
        tensors = {name: values, f"{stem}.scales": scales}
        return tensors if offsets is None else {**tensors, f"{stem}.offsets": offsets}
    if layout == "int4":
        # In pieces of rows: the packing is local to blocks of 64 rows, so the bytes are
        # the same, and the widened copies (int32: 8x the stored bytes) stay small.
        pieces = [
            _int4(raw[at : at + _PIECE_ROWS], kind, None) for at in range(0, len(raw), _PIECE_ROWS)
        ]
        packed, scale_zero = torch.cat([p for p, _ in pieces]), torch.cat([z for _, z in pieces], 1)
    else:
        packing = _cuda_packing()
        assert packing is not None, "int4_cuda needs the GPU's packing"
        # (unpacked and packed on the GPU: a large model's in seconds)
        packed, scale_zero = _int4(raw.to("cuda"), kind, packing[1])
    return {name: packed, f"{stem}.scale_zero": scale_zero.contiguous().cpu()}


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


def stored_op(op: str, x: torch.Tensor, *stored: object) -> torch.Tensor:
    """What a module computes from its stored weight, by `op`: a product of x [rows, in]
    ("int4", "q8"; "gguf": GGUF's blocks (with the type's name and the bias) de-quantized,
    then `F.linear` on x of any shape; "packed": a safetensors format's tensors, its form
    and the bias, `packed_quant`), or the float32 rows of a table that ids [...] look
    up ("q8_rows", "gguf_rows"). Under torch.compile each is one opaque op: inductor may
    not re-lay out what it computes inside, nor fuse it with what follows (a multiply
    fused with a later add becomes one rounding, not two), so a compiled model gives the
    same bits wherever its weights came from. One exception: a q8 product of one row on a
    CPU is written out (`q8_one_row`), so that inductor reads the int8 weight once in one
    loop instead of widening each block column to float32 for MKL."""
    if torch.compiler.is_compiling():
        if op == "q8" and x.shape[0] == 1 and x.device.type == "cpu":
            return q8_one_row(x, *stored)
        if op == "int4":  # (its casts fused into the kernels around: ~5% a CPU step)
            return _OPAQUE[op](x.to(torch.bfloat16), *stored).to(x.dtype)
        return _OPAQUE[op](x, *stored)
    return _EAGER[op](x, *stored)


def q8_one_row(
    x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None
) -> torch.Tensor:
    """`q8_matmul` of x [1, in], as plain tensor operations for a compiled step: each block
    column's 32 products summed, scaled, then the columns summed. Inductor makes of it a
    loop over the int8 weight at the memory's rate (the eager form widens each column to
    float32: 113 MB written a step for the default model's head, ~6-16 ms). The sums' order
    is the kernel's, so its bits may differ from the eager product's (as the compiled
    float32 step's do); it is the same in a compiled offloaded step, whose weights are
    inputs of the same loop (tests/engine/test_cpu_step.py). x is put in a buffer first:
    else inductor computes it where the loop reads it, the model's last norm again for
    every block of outputs (the default model's head 2.65 -> 0.92 ms, the same bits)."""
    from torch._inductor import inductor_prims

    x = inductor_prims.force_stride_order(x, (x.shape[-1], 1))
    columns = x.reshape(values.shape[0], 1, values.shape[-1])
    parts = (columns * values.to(x.dtype)).sum(-1) * scales.to(x.dtype)  # [blocks, out]
    if offsets is not None:  # (each offset times its group's inputs' sum)
        parts = parts + columns.sum(-1) * offsets.to(x.dtype)
    return parts.sum(0, keepdim=True)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """x [rows, in] (any float dtype) times an int4 weight: bfloat16 activations, as the
    kernel takes them; the result in x's dtype."""
    out = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, GROUP, scale_zero)
    return out.to(x.dtype)


def int4_cuda_matmul(
    x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor
) -> torch.Tensor:
    """x [rows, in] times a weight in the GPU's int4 packing (bfloat16 activations)."""
    out = torch.ops.aten._weight_int4pack_mm(
        x.to(torch.bfloat16).contiguous(), packed, GROUP, scale_zero
    )
    return out.to(x.dtype)


Q8_FEW_ROWS = 8  # up to this many rows a slice is the whole weight (measured: no faster)
Q8_SLICE = 16384  # weight rows


def q8_matmul(
    x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None
) -> torch.Tensor:
    """x [rows, in] times a q8 weight, one block column at a time (a scratch of one column,
    never the whole weight in float), in x's dtype. One path for any number of rows: torch's
    int8 kernel is faster for one row but rounds the activations to bfloat16, so a row's
    logits would depend on how many rows share its step (docs/design.md). Past
    `Q8_FEW_ROWS` rows, a slice of `Q8_SLICE` weight rows at a time, so that the sums stay
    in the cache: the default model's head at 32 rows 67 -> 18 ms, at 64 147 -> 32 (each
    output's sums are the same, so are its bits)."""
    columns = x.reshape(x.shape[0], values.shape[0], values.shape[-1]).transpose(0, 1)
    sums_in = None if offsets is None else columns.sum(-1).T  # [rows, blocks]
    slice_rows = values.shape[1] if x.shape[0] <= Q8_FEW_ROWS else Q8_SLICE
    out = x.new_empty(x.shape[0], values.shape[1])
    for start in range(0, values.shape[1], slice_rows):
        end = start + slice_rows
        sums = out[:, start:end]
        weights = zip(columns, values[:, start:end], scales[:, start:end], strict=True)
        for i, (column, q, d) in enumerate(weights):
            part = torch.mm(column, q.to(x.dtype).T).mul_(d.to(x.dtype))
            if i:
                sums.add_(part)
            else:
                sums.copy_(part)
        if sums_in is not None:  # (each offset times its group's inputs' sum)
            sums.add_(torch.mm(sums_in, offsets[:, start:end].to(x.dtype)))
    return out


def gguf_linear(
    x: torch.Tensor, raw: torch.Tensor, kind: str, bias: torch.Tensor | None
) -> torch.Tensor:
    """`F.linear` with the float32 weight GGUF's blocks give (then x's dtype)."""
    return F.linear(x, dequantize(raw, kind).to(x.dtype), bias)


def q8_rows(
    ids: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None
) -> torch.Tensor:
    flat = ids.reshape(-1)
    return q8_values(
        values[:, flat], scales[:, flat], None if offsets is None else offsets[:, flat]
    )


def gguf_rows(ids: torch.Tensor, raw: torch.Tensor, kind: str) -> torch.Tensor:
    return dequantize(raw[ids.reshape(-1)], kind)


# The opaque ops a compiled step calls (see `stored_op`), defined as offloader/ops.py
# defines its own: a compiled step of the default model as stored makes ~210 such calls.
def _int4_fake(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])


def _int4_cuda_fake(
    x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor
) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0] * 8)


def _q8_fake(
    x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty(x.shape[0], values.shape[1])


def _gguf_fake(
    x: torch.Tensor, raw: torch.Tensor, kind: str, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], raw.shape[0])


def _q8_rows_fake(
    ids: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None
) -> torch.Tensor:
    return scales.new_empty(ids.numel(), values.shape[0] * values.shape[2], dtype=torch.float32)


def _gguf_rows_fake(ids: torch.Tensor, raw: torch.Tensor, kind: str) -> torch.Tensor:
    block = FORMATS[kind]
    width = raw.shape[-1] // block.block_bytes * block.block_size
    return raw.new_empty(ids.numel(), width, dtype=torch.float32)


_PRODUCT = "(Tensor x, Tensor weight, Tensor scales) -> Tensor"
_OPAQUE = {
    "packed": packed_linear_op,
    "int4": define_op("int4_matmul", _PRODUCT, int4_matmul, _int4_fake),
    "int4_cuda": define_op("int4_cuda_matmul", _PRODUCT, int4_cuda_matmul, _int4_cuda_fake),
    "q8": define_op(
        "q8_matmul",
        "(Tensor x, Tensor weight, Tensor scales, Tensor? offsets) -> Tensor",
        q8_matmul,
        _q8_fake,
    ),
    "gguf": define_op(
        "gguf_linear",
        "(Tensor x, Tensor raw, str kind, Tensor? bias) -> Tensor",
        gguf_linear,
        _gguf_fake,
    ),
    "q8_rows": define_op(
        "q8_rows",
        "(Tensor ids, Tensor values, Tensor scales, Tensor? offsets) -> Tensor",
        q8_rows,
        _q8_rows_fake,
    ),
    "gguf_rows": define_op(
        "gguf_rows", "(Tensor ids, Tensor raw, str kind) -> Tensor", gguf_rows, _gguf_rows_fake
    ),
}
_EAGER = {
    "packed": packed_linear,
    "int4": int4_matmul, "int4_cuda": int4_cuda_matmul, "q8": q8_matmul, "gguf": gguf_linear, "q8_rows": q8_rows,
    "gguf_rows": gguf_rows,
}  # fmt: skip
