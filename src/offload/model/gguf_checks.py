"""A .gguf's header checked before any reader (gguf's, transformers') sees it: every
count and length against the bytes of the file (`gguf_header.read_header`), the model's
sizes against the limits config.json gets (`limits.py`), the heads against the hidden
size, the tokenizer's ids against its token list, and the tensors' byte ranges against
the file and each other. gguf's reader builds a table as long as `block_count` and walks
an array item by item, so a single hostile field would otherwise hang the process or eat
its memory (`llama.block_count = 10**9` in a small file ate gigabytes: docs/benchmarks.md)."""

from __future__ import annotations

import functools
import itertools
import math
import re
import struct
from pathlib import Path
from types import SimpleNamespace

from offload.errors import ModelError, shown
from offload.model.gguf_read import Header, HeaderTensor, read_header
from offload.model.gguf_shapes import check_shapes
from offload.model.limits import check_parameters, size_limit

_FIXED_BYTES = 24  # magic, version, tensor count, settings count
# `{arch}.<key>` -> the config.json name transformers gives it (its limit is that one's).
_SIZES = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "context_length": "max_position_embeddings",
    "vocab_size": "vocab_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.value_length": "head_dim",
    "rope.dimension_count": "head_dim",
    "expert_count": "num_local_experts",
    "expert_used_count": "num_experts_per_tok",
}
_AT_LEAST_ONE = (
    "block_count",
    "embedding_length",
    "context_length",
    "attention.key_length",
    "attention.value_length",
)
_NO_ATTENTION = ("mamba", "rwkv")  # architectures whose head counts may be 0
_TOKEN_IDS = ("bos", "eos", "unknown", "padding", "seperator", "cls", "mask", "eot", "eom")
_TOKENS = "tokenizer.ggml.tokens"
_PER_TOKEN = ("tokenizer.ggml.scores", "tokenizer.ggml.token_type")
_BLOCK = re.compile(r"blk\.(\d+)\.")


def check_gguf_header(source: Path) -> Header:
    """The header of the .gguf `source`, every count, size and id in it checked (a
    ModelError naming the field and what is allowed otherwise). Remembered per version of
    the file: a load asks for it several times."""
    stat = source.stat()
    return _checked(source, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _checked(source: Path, num_bytes: int, mtime_ns: int) -> Header:
    check_fixed_part(source)
    header = read_header(source)
    where = f"{source}:"
    if header.arch is None:
        raise ModelError(f"{where} general.architecture is missing; a GGUF model names it")
    check_sizes(header, where)
    check_floats(header, where)
    check_tensors(header, where)
    check_heads(header, where)
    check_tokenizer(header, where)
    check_shapes(header, where)
    return header


def check_fixed_part(source: Path) -> None:
    """The magic, the version, and the two counts against the file's size."""
    with source.open("rb") as file:
        head = file.read(_FIXED_BYTES)
    size = source.stat().st_size
    if len(head) < _FIXED_BYTES or head[:4] != b"GGUF":
        raise ModelError(f"{source} is not a GGUF file (it does not start with a GGUF header)")
    version, tensors, settings = struct.unpack("<IQQ", head[4:])
    if version > 0xFFFF:  # written big-endian
        version, tensors, settings = struct.unpack(">IQQ", head[4:])
    if version not in (2, 3):
        raise ModelError(f"{source} has GGUF version {version}; versions 2 and 3 are read")
    # The least bytes a tensor's description and a setting take (a one-byte name).
    if _FIXED_BYTES + tensors * (8 + 1 + 4 + 8 + 4 + 8) + settings * (8 + 1 + 4 + 1) > size:
        raise ModelError(
            f"{source} is damaged or truncated: its header lists {tensors} tensors and "
            f"{settings} settings, more than its {size} bytes can hold"
        )


def check_tensors(header: Header, where: str) -> None:
    """Each tensor of a known type, whole blocks a row, inside the file, at an aligned
    offset; no two tensors' bytes overlap; no block beyond block_count."""
    for tensor in header.tensors:
        _check_tensor(tensor, header, where)
    spans = sorted((t.offset, t.offset + t.num_bytes, t.name) for t in header.tensors)
    for (_, end, name), (start, _, other) in itertools.pairwise(spans):
        if start < end:
            raise ModelError(f"{where} tensors {name!r} and {other!r} overlap in the file")
    blocks = {int(m.group(1)) for t in header.tensors if (m := _BLOCK.match(t.name))}
    count = header.numbers.get(f"{header.arch}.block_count")
    if blocks and isinstance(count, int) and not max(blocks) < count <= max(blocks) + 1:
        raise ModelError(
            f"{where} {header.arch}.block_count={count}, but its tensors are of blocks 0 to "
            f"{max(blocks)}: it must be {max(blocks) + 1}"
        )


def _check_tensor(tensor: HeaderTensor, header: Header, where: str) -> None:
    import gguf

    name = f"{where} tensor {tensor.name!r}"
    if tensor.kind.startswith("type "):
        known = ", ".join(str(int(kind)) for kind in gguf.GGMLQuantizationType)
        raise ModelError(f"{name} is of GGUF {tensor.kind}; the types gguf reads are {known}")
    if min(tensor.dims) < 1:
        raise ModelError(f"{name} has dimensions {list(tensor.dims)}; each must be at least 1")
    block_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[tensor.kind]][0]
    if block_size > 1 and len(tensor.dims) == 1:  # (ggml quantizes matrices only)
        raise ModelError(
            f"{name} is a vector of {tensor.kind} blocks; a vector is stored as floats "
            "(F32, F16, BF16)"
        )
    if tensor.dims[0] % block_size:
        raise ModelError(
            f"{name} has rows of {tensor.dims[0]} values, not whole {tensor.kind} blocks of "
            f"{block_size}"
        )
    if tensor.offset % header.alignment:
        raise ModelError(
            f"{name} starts at byte {tensor.offset}, not at a multiple of the file's "
            f"alignment ({header.alignment})"
        )
    if tensor.offset + tensor.num_bytes > header.num_bytes:
        raise ModelError(
            f"{where} is truncated: tensor {tensor.name!r} ends at byte "
            f"{tensor.offset + tensor.num_bytes}, past its end ({header.num_bytes})"
        )


def _integer(header: Header, key: str, where: str) -> int | None:
    """The integer setting `key`, None when absent or an array (refused otherwise)."""
    if key not in header.keys or key in header.arrays:
        return None
    value = header.numbers.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        given = f"={shown(value)}" if key in header.numbers else " is not a number"
        raise ModelError(f"{where} {key}{given}; it must be an integer")
    return value


def check_sizes(header: Header, where: str) -> None:
    """The model's sizes within the limits a config.json's are (`limits.py`)."""
    sizes = {}
    for suffix, config_key in _SIZES.items():
        key = f"{header.arch}.{suffix}"
        value = _integer(header, key, where)
        if value is None:
            continue
        what, limit = size_limit(config_key)
        low = 1 if suffix in _AT_LEAST_ONE else 0
        if not low <= value <= limit:
            raise ModelError(
                f"{where} {key}={value} is out of range: {what} must be {low} to {limit}"
            )
        sizes.setdefault(config_key, value)
    check_parameters(SimpleNamespace(**sizes), Path(where.rstrip(":")))


_POSITIVE = ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon", "rope.freq_base")


def check_floats(header: Header, where: str) -> None:
    """The model's real-valued settings finite, its norms' epsilon and its rotary base
    above 0 (a NaN or a 0 there makes every logit NaN, whatever the dtype)."""
    prefix = f"{header.arch}."
    for key, value in header.numbers.items():
        if not key.startswith(prefix) or not isinstance(value, float):
            continue
        positive = key[len(prefix) :] in _POSITIVE
        if not math.isfinite(value) or (positive and value <= 0):
            allowed = "a finite number above 0" if positive else "a finite number"
            raise ModelError(f"{where} {key}={value}; it must be {allowed}")


def check_heads(header: Header, where: str) -> None:
    """At least one head, the key and value heads a divisor of the heads, and the heads a
    divisor of the hidden size where the file gives no head size of its own."""
    prefix = f"{header.arch}.attention."
    heads = _integer(header, prefix + "head_count", where)
    if heads is None or header.arch.startswith(_NO_ATTENTION):
        return
    hidden = _integer(header, f"{header.arch}.embedding_length", where)
    kv_heads = _integer(header, prefix + "head_count_kv", where)
    if heads < 1:
        raise ModelError(f"{where} {prefix}head_count={heads}; a model needs at least 1 head")
    if kv_heads is not None and (kv_heads < 1 or heads % kv_heads):
        raise ModelError(
            f"{where} {prefix}head_count_kv={kv_heads}: it must divide "
            f"{prefix}head_count={heads} (1 to {heads})"
        )
    has_head_size = prefix + "key_length" in header.keys
    if hidden is not None and not has_head_size and hidden % heads:
        raise ModelError(
            f"{where} {prefix}head_count={heads} does not divide "
            f"{header.arch}.embedding_length={hidden}: each head must have a whole size"
        )


def check_tokenizer(header: Header, where: str) -> None:
    """A token list of 1 to `MAX_VOCAB` strings, as long as each per-token array, no
    longer than the embedding, and each special token's id in it."""
    kind, count = header.arrays.get(_TOKENS, (8, 0))
    limit = size_limit("vocab_size")[1]
    if kind != 8 or not 1 <= count <= limit:  # (GGUFWriter leaves an empty list out)
        raise ModelError(
            f"{where} {_TOKENS} holds {count} items of value type {kind}; it must hold 1 to "
            f"{limit} strings (type 8)"
        )
    for key in _PER_TOKEN:
        if key in header.arrays and header.arrays[key][1] != count:
            raise ModelError(
                f"{where} {key} holds {header.arrays[key][1]} items; it must hold one a token "
                f"({count})"
            )
    embedding = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    if embedding is not None and len(embedding.dims) == 2 and embedding.dims[1] < count:
        raise ModelError(
            f"{where} {_TOKENS} holds {count} tokens, more than token_embd.weight's "
            f"{embedding.dims[1]} rows"
        )
    for name in _TOKEN_IDS:
        key = f"tokenizer.ggml.{name}_token_id"
        token = _integer(header, key, where)
        if token is not None and not 0 <= token < count:
            raise ModelError(
                f"{where} {key}={token} is not a token of its {count}: it must be 0 to {count - 1}"
            )


_CHUNK_BYTES = 16 * 2**20  # read at a time, so a check holds no whole tensor


def check_finite(source: Path, tensors: list[HeaderTensor]) -> None:
    """Every float tensor's values and every quantized block's fp16 scales finite (a NaN
    there, or a tensor read from the wrong bytes, makes the logits NaN in any dtype): a
    ModelError naming the first tensor that holds one. Read in chunks; types without a
    scale table here are left to their reader."""
    import os

    descriptor = os.open(source, os.O_RDONLY)
    try:
        for tensor in tensors:
            bad = _nonfinite(descriptor, tensor)
            if bad:
                what = "values" if tensor.kind in _FLOAT_BITS else "block scales"
                raise ModelError(
                    f"{source}: tensor {tensor.name!r} ({tensor.kind}) holds {bad} nan or inf "
                    f"{what}: the file is damaged (a weight must be finite)"
                )
    finally:
        os.close(descriptor)


# Float types: (bytes a value, the exponent bits, all set in a nan or an inf).
_FLOAT_BITS = {"F32": (4, 0x7F800000), "F16": (2, 0x7C00), "BF16": (2, 0x7F80)}


def _nonfinite(descriptor: int, tensor: HeaderTensor) -> int:
    """How many of `tensor`'s float values or block scales are nan or inf."""
    import os

    import numpy as np

    from offload.quant.gguf_quants import FORMATS, SCALES_AT

    if tensor.kind in _FLOAT_BITS:
        unit, exponent = _FLOAT_BITS[tensor.kind]
        fields, starts = np.dtype(f"<u{unit}"), (0,)
    elif tensor.kind in SCALES_AT:
        unit, exponent = FORMATS[tensor.kind].block_bytes, 0x7C00
        fields, starts = np.dtype("<u2"), SCALES_AT[tensor.kind]
    else:
        return 0
    step = max(unit, _CHUNK_BYTES // unit * unit)  # (whole blocks or values a read)
    bad = 0
    for at in range(0, tensor.num_bytes, step):
        raw = os.pread(descriptor, min(step, tensor.num_bytes - at), tensor.offset + at)
        units = np.frombuffer(raw, np.uint8).reshape(-1, unit)
        for start in starts:
            bits = units[:, start : start + fields.itemsize].copy().view(fields)
            bad += int(np.count_nonzero((bits & exponent) == exponent))
    return bad
