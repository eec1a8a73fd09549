"""Small .gguf files written here for the conversion's tests, and what a converted folder
holds, read back whole.

`write_llama_gguf` writes a random Llama as llama.cpp lays one out (GGUF names; the query
and key rows in its rotary order, which for random rows only matters in that they move)
with a byte-level tokenizer of 257 tokens, so that the file is mostly layers, not the
embedding: its blocks are random bytes with small float16 scales (no quantizer runs)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from offload.memory.safetensors import checkpoint_tensors, read_into
from offload.model.gguf_fast import FastReader

_BLOCKS = {"Q4_0": (32, 18), "Q8_0": (32, 34)}  # values and bytes a block; scale first


def _blocks(rng: np.random.Generator, rows: int, values: int, kind: str) -> np.ndarray:
    size, num_bytes = _BLOCKS[kind]
    data = rng.integers(0, 256, (rows, values // size, num_bytes), dtype=np.uint8)
    scales = (rng.random((rows, values // size)) * 0.02 + 1e-3).astype(np.float16)
    data[..., :2] = scales[..., None].view(np.uint8)
    return data.reshape(rows, -1)


def write_llama_gguf(
    path: Path,
    hidden: int = 64,
    layers: int = 2,
    kind: str = "Q4_0",
    float_queries: bool = False,
) -> Path:
    """A random Llama of `layers` layers of width `hidden` (4 heads, 2 of keys and values,
    an MLP twice as wide), every matrix in `kind` blocks (the queries in float16 where
    `float_queries`), the norms float32, the head tied to the embedding."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    writer = gguf.GGUFWriter(path, "llama")
    for add, value in (
        (writer.add_context_length, 256), (writer.add_embedding_length, hidden),
        (writer.add_block_count, layers), (writer.add_feed_forward_length, 2 * hidden),
        (writer.add_head_count, 4), (writer.add_head_count_kv, 2),
        (writer.add_rope_freq_base, 10000.0), (writer.add_layer_norm_rms_eps, 1e-5),
    ):  # fmt: skip
        add(value)
    tokens = [*bytes_to_unicode().values(), "Ġt"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    rng = np.random.default_rng(0)
    kv, inner = hidden // 2, 2 * hidden
    shapes = {"token_embd.weight": (len(tokens), hidden)}
    for i in range(layers):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.attn_q.weight": (hidden, hidden),
            f"blk.{i}.attn_k.weight": (kv, hidden), f"blk.{i}.attn_v.weight": (kv, hidden),
            f"blk.{i}.attn_output.weight": (hidden, hidden),
            f"blk.{i}.ffn_norm.weight": (hidden,), f"blk.{i}.ffn_gate.weight": (inner, hidden),
            f"blk.{i}.ffn_up.weight": (inner, hidden), f"blk.{i}.ffn_down.weight": (hidden, inner),
        })  # fmt: skip
    shapes["output_norm.weight"] = (hidden,)
    for name, shape in sorted(shapes.items()):  # (by name, as llama.cpp's are not by use)
        if len(shape) == 1:
            writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        elif float_queries and ".attn_q." in name:
            writer.add_tensor(name, (0.05 * rng.standard_normal(shape)).astype(np.float16))
        else:
            data = _blocks(rng, *shape, kind)
            writer.add_tensor(
                name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType[kind]
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor a model folder holds, as the loader finds them (those it reads from
    the .gguf in place included), read whole."""
    tensors = {}
    for name, stored in checkpoint_tensors(folder).items():
        tensors[name] = torch.empty(stored.shape, dtype=stored.dtype)
        read_into(stored, tensors[name])
    return tensors


def first_layers_of(source: Path, path: Path, layers: int) -> Path:
    """`source` (a .gguf) cut to its first `layers` blocks: the same metadata (tokenizer,
    chat template), embedding, norms and block kinds, the real weights of those blocks."""
    reader = FastReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(path, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # (the writer's own)
        value = layers if name == f"{arch}.block_count" else field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, vtype, sub_type=sub)
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and int(tensor.name.split(".")[1]) >= layers:
            continue
        writer.add_tensor(
            tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
