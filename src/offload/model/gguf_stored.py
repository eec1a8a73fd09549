"""A GGUF file as stored: its tensors' own bytes in a safetensors file, under transformers'
names, with the config and tokenizer beside them. Nothing is de-quantized: a quantized
tensor is uint8 [rows, bytes per row] (`gguf_quants` reads it), a float one keeps its dtype.

config.json names each quantized weight's GGUF type in its `quantization_config`
(`{"quant_method": "gguf", "weight_types": {name: "Q4_1", ...}}`), so the model is built
with quantized modules before a byte is read (`model/quantized.py`).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from offload.errors import ModelError
from offload.model.gguf_quants import FORMATS
from offload.model.layout_choice import LayoutChooser
from offload.model.quant_layouts import laid_out, stored_settings

# The GGUF architectures read as stored, and whether llama.cpp permuted their query and key
# rows (for its interleaved rotary layout): those are put back in transformers' order.
_ARCHITECTURES = {"llama": True, "qwen2": False, "qwen3": False}
_FLOATS = {"F32": ("F32", np.float32), "F16": ("F16", np.float16)}


def save_as_stored(source: Path, out_dir: Path, kernels: str = "gguf") -> None:
    """Write `source`'s config, tokenizer and stored tensors into `out_dir`: in GGUF's own
    blocks (`kernels="gguf"`, any device), or laid out for the CPU's or the GPU's kernels
    (`kernels="cpu"` or `"cuda"`: `quant_layouts.py`)."""
    import gguf

    from offload.model.default import gguf_parsed_once

    reader = gguf.GGUFReader(source)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    why = not_read_as_stored(source, reader)
    if why is not None:
        raise ModelError(f"{source}: {why}; dtype='float32' (--dtype float32) converts it")
    from transformers import AutoConfig, AutoTokenizer

    with gguf_parsed_once():
        config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    names = _hf_names(arch, config)
    tensors: dict[str, tuple[str, list[int], np.ndarray]] = {}
    weight_types: dict[str, str] = {}
    layouts: dict[str, str] = {}
    chooser = LayoutChooser(kernels)
    for tensor in reader.tensors:
        if tensor.name not in names:
            raise ModelError(f"{source}: tensor {tensor.name!r} has no place in a {arch} model")
        name, kind = names[tensor.name], tensor.tensor_type.name
        data = np.asarray(tensor.data)
        if _ARCHITECTURES[arch] and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            heads = config.num_attention_heads if ".attn_q." in tensor.name else _kv_heads(config)
            data = _unpermute_rows(data, heads)
        if kind in _FLOATS:
            dtype, numpy_type = _FLOATS[kind]
            tensors[name] = (dtype, list(data.shape), data.astype(numpy_type, copy=False))
        elif kind in FORMATS:
            weight_types[name] = kind
            layout = chooser.choose(name, data, kind)
            if layout != "gguf":
                layouts[name] = layout
            tensors.update(_laid_out(name, data, kind, layout))
        else:  # (`not_read_as_stored` said otherwise: the file changed meanwhile)
            raise ModelError(f"{source}: {tensor.name} is stored as {kind}, not read as stored")
    settings = config.to_dict()
    settings["quantization_config"] = stored_settings(weight_types, layouts)
    if chooser.seconds:  # (what the choice of each layout was made on)
        settings["quantization_config"]["layout_seconds"] = {
            key: {layout: round(s, 7) for layout, s in seconds.items()}
            for key, seconds in chooser.seconds.items()
        }
    settings.pop("torch_dtype", None)
    settings.pop("dtype", None)  # (the activations' dtype is the user's choice: float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(settings, indent=2, sort_keys=True))
    tokenizer.save_pretrained(out_dir)
    _write_safetensors(out_dir / "model.safetensors", tensors)


def _laid_out(
    name: str, data: np.ndarray, kind: str, layout: str
) -> dict[str, tuple[str, list[int], np.ndarray]]:
    """The safetensors entries of one quantized weight in `layout`."""
    if layout == "gguf":
        return {name: ("U8", list(data.shape), data)}
    raw = torch.from_numpy(np.array(data))  # (a copy: the reader maps the file read-only)
    return {
        key: (_SAFE_TYPES[t.dtype], list(t.shape), _as_numpy(t))
        for key, t in laid_out(name, raw, kind, layout).items()
    }


_SAFE_TYPES = {
    torch.uint8: "U8", torch.int8: "I8", torch.int32: "I32", torch.float16: "F16",
    torch.bfloat16: "BF16", torch.float32: "F32",
}  # fmt: skip


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """numpy has no bfloat16: its bytes go as int16 (the header says BF16)."""
    return (tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor).numpy()


def _kv_heads(config: Any) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def not_read_as_stored(source: Path, reader: Any = None) -> str | None:
    """Why the .gguf `source` cannot be read as stored (its architecture, or a tensor type
    with no reader here: an IQ type, ...), or None where it can. Without `reader`, from
    the header alone (`gguf_header`: ~0.1 s where gguf's reader takes ~2 s)."""
    if reader is not None:
        arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
        types = [(tensor.name, tensor.tensor_type.name) for tensor in reader.tensors]
    else:
        arch, types = gguf_header(source)
    if arch not in _ARCHITECTURES:
        return (
            f"GGUF architecture {arch!r} is not read as stored yet (these are: "
            f"{', '.join(_ARCHITECTURES)})"
        )
    for name, kind in types:
        if kind not in FORMATS and kind not in _FLOATS:
            return (
                f"{name} is stored as {kind}, not read as stored yet (these are: "
                f"{', '.join([*FORMATS, *_FLOATS])})"
            )
    return None


# Bytes of each scalar GGUF value type (8 is a string, 9 an array: read as they come).
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_header(source: Path) -> tuple[str | None, list[tuple[str, str]]]:
    """A .gguf's architecture and its tensors' (name, type name), read from its header
    only, past every other setting (the tokenizer's arrays included) without building
    them. The counts are checked against the file's size first (`check_gguf_header`); a
    header that runs past the file's end is a `struct.error`."""
    import mmap

    import gguf

    from offload.model.default import check_gguf_header

    check_gguf_header(source)
    with source.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        order = "<" if struct.unpack_from("<I", data, 4)[0] <= 0xFFFF else ">"
        tensors, settings = struct.unpack_from(order + "QQ", data, 8)
        at, arch = 24, None

        def string(at: int) -> tuple[bytes, int]:
            (length,) = struct.unpack_from(order + "Q", data, at)
            if at + 8 + length > len(data):
                raise struct.error("a string runs past the end of the file")
            return data[at + 8 : at + 8 + length], at + 8 + length

        def skip(kind: int, at: int) -> int:
            if kind == 8:
                return string(at)[1]
            if kind != 9:
                return at + _SCALAR_BYTES[kind]
            item, count = struct.unpack_from(order + "IQ", data, at)
            at += 12
            if item in _SCALAR_BYTES:
                return at + count * _SCALAR_BYTES[item]
            for _ in range(count):
                at = skip(item, at)
            return at

        for _ in range(settings):
            key, at = string(at)
            (kind,) = struct.unpack_from(order + "I", data, at)
            if key == b"general.architecture" and kind == 8:
                value, at = string(at + 4)
                arch = value.decode()
            else:
                at = skip(kind, at + 4)
        found = []
        for _ in range(tensors):
            name, at = string(at)
            (dims,) = struct.unpack_from(order + "I", data, at)
            (kind,) = struct.unpack_from(order + "I", data, at + 4 + 8 * dims)
            at += 4 + 8 * dims + 4 + 8  # (dimensions, type, offset)
            try:
                kind_name = gguf.GGMLQuantizationType(kind).name
            except ValueError:
                kind_name = f"type {kind}"
            found.append((name.decode(), kind_name))
    return arch, found


def _unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's query/key row order back to transformers': within each head, its
    interleaved (even, odd) rows become (first half, second half). Rows move whole, so a
    quantized row's bytes move unchanged (transformers does the same on the floats)."""
    half = rows.shape[0] // heads // 2
    return np.ascontiguousarray(
        rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
    )


def _hf_names(arch: str, config: Any) -> dict[str, str]:
    """GGUF tensor name -> transformers parameter name, from gguf's own table."""
    import gguf

    arch_id = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch)
    table = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    parts = ["model.embed_tokens", "model.norm", "lm_head"]
    layer = ["input_layernorm", "post_attention_layernorm"]
    layer += [f"self_attn.{p}_proj" for p in "qkvo"] + [
        f"mlp.{p}_proj" for p in ("gate", "up", "down")
    ]
    layer += ["self_attn.q_norm", "self_attn.k_norm"]  # (Qwen3)
    parts += [f"model.layers.{i}.{p}" for i in range(config.num_hidden_layers) for p in layer]
    names = {}
    for part in parts:
        gguf_name = table.get_name(part)
        if gguf_name is not None:
            for suffix in ("weight", "bias"):
                names[f"{gguf_name}.{suffix}"] = f"{part}.{suffix}"
    return names


_SAFETENSORS_ALIGN = 8


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], np.ndarray]]) -> None:
    """A safetensors file written tensor by tensor (never a second copy of the whole)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [offset, offset + data.nbytes],
        }
        offset += data.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % _SAFETENSORS_ALIGN)
    with path.open("wb") as file:
        file.write(struct.pack("<Q", len(text)))
        file.write(text)
        for _, _, data in tensors.values():
            file.write(np.ascontiguousarray(data).data)
