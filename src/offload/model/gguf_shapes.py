"""A .gguf's tensors' dimensions against its own settings, for the architectures read as
stored (llama, qwen2, qwen3): a `feed_forward_length` or `embedding_length` that its
tensors disagree with is named here, before transformers builds a model of the settings'
sizes and fails to load the tensors into it in its own words."""

from __future__ import annotations

import re

from offload.errors import ModelError
from offload.model.gguf_read import Header

_SHAPED = ("llama", "qwen2", "qwen3")
_BLOCK = re.compile(r"blk\.\d+\.")


def check_shapes(header: Header, where: str) -> None:
    """Each tensor of a layer (and the norms, the embedding's and the head's width) has
    the dimensions the settings make (GGUF's order: inputs first)."""
    sizes = _sizes(header)
    if header.arch not in _SHAPED or sizes is None:
        return
    rotary = header.numbers.get(f"{header.arch}.rope.dimension_count")
    if rotary is not None and rotary != sizes["key_size"]:  # (llama.cpp refuses it too)
        raise ModelError(
            f"{where} {header.arch}.rope.dimension_count={rotary}; it must be the head size, "
            f"{sizes['key_size']}"
        )
    expected = _expected(**sizes)
    for tensor in header.tensors:
        block = _BLOCK.match(tensor.name)
        part = tensor.name[block.end() :] if block else tensor.name
        want = expected.get(part)
        if part in ("token_embd.weight", "output.weight"):  # (rows: the vocabulary's)
            want = (sizes["hidden"], *tensor.dims[1:])
        if want is not None and tensor.dims != want:
            said = ", ".join(f"{name} {value}" for name, value in sizes.items() if value)
            raise ModelError(
                f"{where} tensor {tensor.name!r} has dimensions {list(tensor.dims)}; the file's "
                f"settings ({said}) make {list(want)}"
            )


def _sizes(header: Header) -> dict[str, int] | None:
    """hidden, ff, heads, kv heads, key and value head sizes (None where the heads or the
    width are missing; the checks before this one made them integers)."""
    prefix = f"{header.arch}."
    numbers = {key[len(prefix) :]: v for key, v in header.numbers.items() if key.startswith(prefix)}
    hidden, heads = numbers.get("embedding_length"), numbers.get("attention.head_count")
    if not isinstance(hidden, int) or not isinstance(heads, int) or heads < 1:
        return None
    key = numbers.get("attention.key_length") or hidden // heads
    return {
        "hidden": hidden,
        "ff": numbers.get("feed_forward_length") or 0,
        "heads": heads,
        "kv_heads": numbers.get("attention.head_count_kv") or heads,
        "key_size": key,
        "value_size": numbers.get("attention.value_length") or key,
    }


def _expected(
    hidden: int, ff: int, heads: int, kv_heads: int, key_size: int, value_size: int
) -> dict[str, tuple[int, ...]]:
    expected = {
        "attn_norm.weight": (hidden,),
        "ffn_norm.weight": (hidden,),
        "output_norm.weight": (hidden,),
        "attn_q.weight": (hidden, heads * key_size),
        "attn_k.weight": (hidden, kv_heads * key_size),
        "attn_v.weight": (hidden, kv_heads * value_size),
        "attn_output.weight": (heads * value_size, hidden),
        "attn_q.bias": (heads * key_size,),
        "attn_k.bias": (kv_heads * key_size,),
        "attn_v.bias": (kv_heads * value_size,),
        "attn_q_norm.weight": (key_size,),
        "attn_k_norm.weight": (key_size,),
    }
    if ff:
        expected |= {
            "ffn_gate.weight": (hidden, ff),
            "ffn_up.weight": (hidden, ff),
            "ffn_down.weight": (ff, hidden),
        }
    return expected
