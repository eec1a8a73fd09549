"""The vocabulary of quantized weights, each equal to its string (`StrEnum`), so that
config.json, a packed layer's form and the flags keep their shapes: the layout a GGUF
weight is kept in, the packed safetensors formats' kinds, and the packed methods.

The modules' forwards name their products by plain strings (`kernels.stored_op`): a
compiled step's guards hold what a forward reads, and dynamo guards an enum member by its
identity, which a step kept on disk (`engine/step_cache.py`) cannot carry over."""

from __future__ import annotations

import enum


class QuantLayout(enum.StrEnum):
    """How a GGUF weight is kept (`layouts.py`; config.json's `weight_layouts`)."""

    Q4 = "q4"  # 4-bit values by 16 outputs, for the integer products of `row_q4.c`
    INT4 = "int4"  # torch's CPU int4 packing
    INT4_CUDA = "int4_cuda"  # torch's GPU int4 packing (tinygemm's tiles)
    Q8 = "q8"  # int8 by block column, with scales (and offsets)
    GGUF = "gguf"  # the file's own blocks, de-quantized at each forward


class PackedKind(enum.StrEnum):
    """The format of a packed layer, the first part of its form ("gptq:4:v1")."""

    CT_PACKED = "ct_packed"  # compressed-tensors pack-quantized
    CT_PLAIN = "ct_plain"  # compressed-tensors int-, naive- and float-quantized
    GPTQ = "gptq"
    AWQ = "awq"
    FP8 = "fp8"


class PackedMethod(enum.StrEnum):
    """A packed checkpoint's `quant_method` (vLLM's aliases folded: `packed_modules.ALIASES`)."""

    COMPRESSED_TENSORS = "compressed-tensors"
    GPTQ = "gptq"
    AWQ = "awq"
    FP8 = "fp8"
