"""A GGUF file as stored: its tensors' own bytes under transformers' names, with the
config and tokenizer beside them: read in place from the .gguf where they are used as
they are, else laid out for a kernel into a safetensors file (`gguf_plan.py`). Nothing is
de-quantized: a quantized tensor is uint8 [rows, bytes per row] (`gguf_quants` reads it)
or its layout's tensors, a float one keeps its dtype.

config.json names each quantized weight's GGUF type in its `quantization_config`
(`{"quant_method": "gguf", "weight_types": {name: "Q4_1", ...}}`), so the model is built
with quantized modules before a byte is read (`model/quantized.py`).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from offload.errors import ModelError
from offload.model.gguf_plan import FLOATS, Planned, SourceTensor, plan, row_orders
from offload.model.gguf_quants import FORMATS
from offload.model.gguf_settings import ROW_ORDERS_KEY
from offload.model.gguf_write import LazyRows, check_free_space, write_planned
from offload.model.layout_choice import LayoutChooser
from offload.model.quant_layouts import stored_settings

# The GGUF architectures read as stored, and whether llama.cpp permuted their query and key
# rows (for its interleaved rotary layout): those are put back in transformers' order.
_ARCHITECTURES = {"llama": True, "qwen2": False, "qwen3": False}


def save_as_stored(
    source: Path, out_dir: Path, kernels: str = "gguf", progress: bool | None = None
) -> None:
    """Write `source`'s config, tokenizer and stored tensors into `out_dir`: in GGUF's own
    blocks (`kernels="gguf"`, any device), or laid out for the CPU's or the GPU's kernels
    (`kernels="cpu"` or `"cuda"`: `quant_layouts.py`). One tensor at a time, and tensors
    used as the file has them are not copied (`gguf_plan.py`, `gguf_write.py`); the free
    space is checked before anything is written. `progress`: a bar (default: on a
    terminal)."""
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
    sources = _source_tensors(source, reader, arch, config)
    native = reader.byte_order == "I"  # (float tensors can be read as they are)
    del reader  # (its mapping of the file: no tensor is read through it)
    chooser = LayoutChooser(kernels)
    descriptor = os.open(source, os.O_RDONLY)
    try:
        planned = plan(
            sources,
            lambda s: chooser.choose(s.name, LazyRows(descriptor, s), s.kind),
            floats_referable=native,
        )
    finally:
        os.close(descriptor)
    check_free_space(out_dir, source, planned)
    (out_dir / "config.json").write_text(json.dumps(_settings(config, planned, chooser), indent=2))
    tokenizer.save_pretrained(out_dir)
    write_planned(source, out_dir, planned, progress)


def _settings(config: Any, planned: list[Planned], chooser: LayoutChooser) -> dict[str, Any]:
    """The converted folder's config.json: the model's, with what it holds as stored."""
    quantized = [p for p in planned if p.layout is not None]
    types = {p.source.name: p.source.kind for p in quantized}
    layouts = {p.source.name: p.layout for p in quantized if p.layout != "gguf"}
    settings = config.to_dict()
    settings["quantization_config"] = stored_settings(types, layouts)
    orders = row_orders(planned)
    if orders:
        settings["quantization_config"][ROW_ORDERS_KEY] = orders
    if chooser.seconds:  # (what the choice of each layout was made on)
        settings["quantization_config"]["layout_seconds"] = {
            key: {layout: round(s, 7) for layout, s in seconds.items()}
            for key, seconds in chooser.seconds.items()
        }
    settings.pop("torch_dtype", None)
    settings.pop("dtype", None)  # (the activations' dtype is the user's choice: float32)
    return dict(sorted(settings.items()))


def _source_tensors(source: Path, reader: Any, arch: str, config: Any) -> list[SourceTensor]:
    """Each tensor of the .gguf under transformers' name, with where its bytes are."""
    names = _hf_names(arch, config)
    found = []
    for tensor in reader.tensors:
        if tensor.name not in names:
            raise ModelError(f"{source}: tensor {tensor.name!r} has no place in a {arch} model")
        kind, heads = tensor.tensor_type.name, 0
        if kind not in FORMATS and kind not in FLOATS:  # (the file changed meanwhile)
            raise ModelError(f"{source}: {tensor.name} is stored as {kind}, not read as stored")
        if _ARCHITECTURES[arch] and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            heads = config.num_attention_heads if ".attn_q." in tensor.name else _kv_heads(config)
        shape = tuple(int(n) for n in tensor.data.shape)
        found.append(
            SourceTensor(
                names[tensor.name], kind, shape, int(tensor.data_offset), int(tensor.n_bytes), heads
            )
        )
    return found


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
        if kind not in FORMATS and kind not in FLOATS:
            return (
                f"{name} is stored as {kind}, not read as stored yet (these are: "
                f"{', '.join([*FORMATS, *FLOATS])})"
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
