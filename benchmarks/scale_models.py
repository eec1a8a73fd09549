"""The random models `scale.py` measures, written once into a folder and reused.

    gguf   a Llama in Q4_0 blocks, hidden 3072, 24 layers, 24 query / 8 KV heads (GQA),
           intermediate 8192, untied head: 1.42 GiB, written with `gguf.GGUFWriter`
           (matrices quantized by `gguf.quants.quantize`) with the default model's
           tokenizer metadata, so that it loads as a .gguf from llama.cpp would
    bf16   a Llama in bfloat16 safetensors, hidden 2048, 24 layers, 32 heads (no GQA: a KV
           cache of 192 KiB a position), intermediate 5632, untied head: 2.67 GiB in ~1 GB
           shards (layers span files), the default model's tokenizer files beside it
    large  (`--large`) a bfloat16 Llama of 6.2 GB: hidden 3072, 28 layers, GQA 24/8

Weights are N(0, 0.02) as transformers initialises them (norms 1), so logits stay finite;
each tensor has its own seeded generator, so a model is the same bytes on every machine.
Memory stays bounded by a block of rows (16 MiB of float32): the GGUF's tensor infos are
declared first and each tensor's blocks written as they are made; a safetensors shard's
header is computed from the shapes alone and each tensor streamed into place after it. Each model is written into
a staging folder renamed into place, with a `manifest.json` of its sizes: a folder with a
manifest is complete and reused.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

SEED = 0
STD = 0.02  # transformers' initializer_range
CHUNK_VALUES = 2**22  # values made at once (16 MiB of float32): memory stays bounded
SHARD_BYTES = 10**9  # not a multiple of a layer: layers span files, as in real checkpoints
_COMMON = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
           "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
SHAPES = {
    "gguf": {**_COMMON, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 24,
             "num_attention_heads": 24, "num_key_value_heads": 8},
    "bf16": {**_COMMON, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
             "num_attention_heads": 32, "num_key_value_heads": 32, "dtype": "bfloat16"},
    "large": {**_COMMON, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
              "num_attention_heads": 24, "num_key_value_heads": 8, "dtype": "bfloat16"},
    # A smoke test of the script (seconds to build, small budgets: --budget-* 0.002).
    "tiny-gguf": {**_COMMON, "hidden_size": 256, "intermediate_size": 512,
                  "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2},
    "tiny-bf16": {**_COMMON, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
                  "num_attention_heads": 4, "num_key_value_heads": 4, "dtype": "bfloat16"},
}  # fmt: skip
LARGE_FREE_FACTOR = 3  # --large only with 3x its size free (our caches and others' files)
# transformers' names of a layer's tensors -> GGUF's, in the order written.
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}  # fmt: skip


def is_gguf(name: str) -> bool:
    """Whether the model `name` is written as a Q4_0 GGUF (the others: bf16 safetensors)."""
    return "dtype" not in SHAPES[name]


def build(folder: Path, name: str) -> dict:
    """The model `name` (a key of SHAPES) in `folder/name`, built once; its manifest."""
    target = folder / name
    if (target / "manifest.json").is_file():
        return load_manifest(folder, name)
    folder.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder))
    try:
        write = _write_gguf if is_gguf(name) else _write_safetensors
        files = write(staging, SHAPES[name])
        manifest = _manifest(name, SHAPES[name], files)
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return load_manifest(folder, name)


def load_manifest(folder: Path, name: str) -> dict:
    manifest = json.loads((folder / name / "manifest.json").read_text())
    root = folder / name
    manifest["model"] = str(root / manifest["model"]) if manifest["model"] != "." else str(root)
    manifest["files"] = [str(root / file) for file in manifest["files"]]
    return manifest


def large_room(folder: Path) -> str | None:
    """None where the disk has room for the large model, else why not."""
    need = _model_bytes(SHAPES["large"], 2) * LARGE_FREE_FACTOR
    free = shutil.disk_usage(folder if folder.exists() else folder.parent).free
    return None if free >= need else f"{free / 2**30:.1f} GiB free, {need / 2**30:.1f} needed"


def tensor_specs(shape: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(transformers' name, shape) of every weight, in the model's order."""
    hidden, inner = shape["hidden_size"], shape["intermediate_size"]
    kv = hidden // shape["num_attention_heads"] * shape["num_key_value_heads"]
    layer = {"input_layernorm": (hidden,), "self_attn.q_proj": (hidden, hidden),
             "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
             "self_attn.o_proj": (hidden, hidden), "post_attention_layernorm": (hidden,),
             "mlp.gate_proj": (inner, hidden), "mlp.up_proj": (inner, hidden),
             "mlp.down_proj": (hidden, inner)}  # fmt: skip
    specs = [("model.embed_tokens.weight", (shape["vocab_size"], hidden))]
    for i in range(shape["num_hidden_layers"]):
        specs += [(f"model.layers.{i}.{part}.weight", dims) for part, dims in layer.items()]
    return [
        *specs,
        ("model.norm.weight", (hidden,)),
        ("lm_head.weight", (shape["vocab_size"], hidden)),
    ]


def random_chunks(name: str, dims: tuple[int, ...]) -> Iterator[torch.Tensor]:
    """float32 N(0, STD) (norms: ones) a block of rows at a time (at most CHUNK_VALUES),
    from a generator seeded by the name alone: the same values on every machine."""
    if name.endswith("norm.weight"):
        yield torch.ones(dims)
        return
    generator = torch.Generator().manual_seed(SEED + zlib.crc32(name.encode()))
    rows_per_chunk = max(1, CHUNK_VALUES // int(np.prod(dims[1:])))
    for start in range(0, dims[0], rows_per_chunk):
        rows = min(rows_per_chunk, dims[0] - start)
        yield torch.randn((rows, *dims[1:]), generator=generator).mul_(STD)


def _model_bytes(shape: dict, bytes_per_value: float) -> int:
    return int(sum(np.prod(dims) for _, dims in tensor_specs(shape)) * bytes_per_value)


# ---- GGUF -----------------------------------------------------------------------------


def _gguf_name(name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
             "output_norm.weight", "lm_head.weight": "output.weight"}  # fmt: skip
    if name in fixed:
        return fixed[name]
    _, _, index, part = name.split(".", 3)
    return f"blk.{index}.{_LAYER[part.removesuffix('.weight')]}.weight"


class _Blocks:
    """A tensor as `GGUFWriter.write_tensor_data` takes it (its `nbytes`, its `tofile`),
    made as it is written: matrices quantized to Q4_0 a block of rows at a time (rows are
    quantized independently: the same bytes as the whole matrix at once), vectors float32."""

    def __init__(self, name: str, dims: tuple[int, ...]):
        self.name, self.dims = name, dims
        values = int(np.prod(dims))
        self.nbytes = values * 4 if len(dims) == 1 else values // 32 * 18

    def tofile(self, out) -> None:
        import gguf

        for chunk in random_chunks(self.name, self.dims):
            data = chunk.numpy()
            if len(self.dims) > 1:
                data = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q4_0)
            data.tofile(out)


def _write_gguf(folder: Path, shape: dict) -> list[Path]:
    import gguf

    from offload.model.default import gguf_path
    from offload.model.gguf_fast import FastReader

    path = folder / "model-Q4_0.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    _copy_tokenizer_fields(FastReader(gguf_path()), writer)
    _add_shape_fields(writer, shape)
    specs = tensor_specs(shape)
    q4_0 = gguf.GGMLQuantizationType.Q4_0
    for name, dims in specs:  # declared first (offsets in the header); written one by one
        if len(dims) == 1:
            writer.add_tensor_info(_gguf_name(name), dims, np.dtype(np.float32), dims[0] * 4)
            continue
        rows, values = dims
        byte_shape = (rows, values // 32 * 18)  # Q4_0: 18 bytes a block of 32 values
        nbytes = rows * byte_shape[1]
        writer.add_tensor_info(_gguf_name(name), byte_shape, np.dtype(np.uint8), nbytes, q4_0)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims in specs:
        writer.write_tensor_data(_Blocks(name, dims))  # type: ignore[arg-type]
    writer.close()
    return [path]


def _copy_tokenizer_fields(source, writer) -> None:
    """The default model's tokenizer and chat template (its `tokenizer.*` fields)."""
    import gguf

    for key, field in source.fields.items():
        if not key.startswith("tokenizer."):
            continue
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)


def _add_shape_fields(writer, shape: dict) -> None:
    import gguf

    heads, hidden = shape["num_attention_heads"], shape["hidden_size"]
    writer.add_name("scale.py random Llama")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(shape["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(shape["num_hidden_layers"])
    writer.add_feed_forward_length(shape["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(shape["num_key_value_heads"])
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(shape["rope_theta"])
    writer.add_layer_norm_rms_eps(shape["rms_norm_eps"])
    writer.add_vocab_size(shape["vocab_size"])


# ---- safetensors ----------------------------------------------------------------------


def _write_safetensors(folder: Path, shape: dict) -> list[Path]:
    specs = tensor_specs(shape)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    shard_bytes = 0
    for name, dims in specs:
        num_bytes = int(np.prod(dims)) * 2
        if shards[-1] and shard_bytes + num_bytes > SHARD_BYTES:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((name, dims))
        shard_bytes += num_bytes
    files, weight_map = [], {}
    for number, shard in enumerate(shards, start=1):
        path = folder / f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(path, shard)
        files.append(path)
        weight_map.update(dict.fromkeys((name for name, _ in shard), path.name))
    total = sum(int(np.prod(dims)) * 2 for _, dims in specs)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps(shape, indent=2))
    _copy_tokenizer_files(folder)
    return files


def _write_shard(path: Path, shard: list[tuple[str, tuple[int, ...]]]) -> None:
    """A safetensors file as `safetensors` writes one (tensors in name order, the header
    padded with spaces to 8 bytes), each tensor made and written in turn."""
    ordered = sorted(shard)
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dims in ordered:
        end = offset + int(np.prod(dims)) * 2
        header[name] = {"dtype": "BF16", "shape": list(dims), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with path.open("wb") as out:
        out.write(len(text).to_bytes(8, "little") + text)
        for name, dims in ordered:
            for chunk in random_chunks(name, dims):
                out.write(chunk.to(torch.bfloat16).view(torch.uint8).numpy().data)


def _copy_tokenizer_files(folder: Path) -> None:
    """The default model's tokenizer (converted once into the offload cache)."""
    from offload.model.default import default_model_path

    source = default_model_path()
    for path in source.iterdir():
        if path.is_file() and path.name.startswith(("tokenizer", "chat_template", "special")):
            shutil.copy2(path, folder / path.name)


# ---- the manifest ---------------------------------------------------------------------


def _manifest(name: str, shape: dict, files: list[Path]) -> dict:
    """Sizes as stored: every weight, the decoder stack, and what a decode step reads
    outside it (the head; the embedding is a row lookup)."""
    gguf = is_gguf(name)
    per_value = 18 / 32 if gguf else 2  # Q4_0 matrices; bf16
    sizes = {}
    for tensor, dims in tensor_specs(shape):
        size = int(np.prod(dims))
        sizes[tensor] = size * 4 if len(dims) == 1 and gguf else int(size * per_value)
    stack = sum(size for tensor, size in sizes.items() if ".layers." in tensor)
    root = files[0].parent
    return {
        "name": name,
        "form": "gguf Q4_0" if gguf else "safetensors bfloat16",
        "model": files[0].name if gguf else ".",
        "files": [file.name for file in files],
        "file_bytes": sum(file.stat().st_size for file in files),
        "weight_bytes": sum(sizes.values()),
        "stack_bytes": stack,
        "layer_bytes": stack // shape["num_hidden_layers"],
        "head_bytes": sizes["lm_head.weight"],
        "outside_stack_bytes": sum(sizes.values()) - stack,
        "config": shape,
        "folder_bytes": sum(p.stat().st_size for p in root.iterdir() if p.is_file()),
    }
