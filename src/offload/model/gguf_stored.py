"""A GGUF file as stored: its tensors' own bytes under transformers' names, with the
config and tokenizer beside them: read in place from the .gguf where they are used as
they are, else laid out for a kernel into a safetensors file (`gguf_plan.py`). Nothing is
de-quantized: a quantized tensor is uint8 [rows, bytes per row] (`gguf_quants` reads it)
or its layout's tensors, a float one keeps its dtype.

config.json names each quantized weight's GGUF type in its `quantization_config`
(`{"quant_method": "gguf", "weight_types": {name: "Q4_1", ...}}`), so the model is built
with quantized modules before a byte is read (`quant/quantized.py`).
"""

from __future__ import annotations

import gc
import json
import os
import struct
from pathlib import Path
from typing import Any

from offload.errors import ModelError
from offload.memory.host import trim_freed_memory
from offload.model.gguf_checks import check_finite
from offload.model.gguf_header import HeaderTensor, gguf_header, gguf_tensors
from offload.model.gguf_plan import FLOATS, Planned, SourceTensor, plan, row_orders
from offload.model.gguf_settings import ROW_ORDERS_KEY
from offload.model.gguf_write import LazyRows, check_free_space, write_planned
from offload.model.tokenizer import save_tokenizer
from offload.quant.choice import BlocksOnly, LayoutChoice
from offload.quant.gguf_quants import FORMATS
from offload.quant.kinds import QuantLayout
from offload.quant.traits import stored_settings

# The GGUF architectures read as stored, and whether llama.cpp permuted their query and key
# rows (for its interleaved rotary layout): those are put back in transformers' order.
_ARCHITECTURES = {"llama": True, "qwen2": False, "qwen3": False}


def save_as_stored(
    source: Path,
    out_dir: Path,
    kernels: str = "gguf",
    progress: bool | None = None,
    chooser: LayoutChoice | None = None,
) -> None:
    """Write `source`'s config, tokenizer and stored tensors into `out_dir`: in GGUF's own
    blocks (`kernels="gguf"`, any device), or laid out for the CPU's or the GPU's kernels
    (`kernels="cpu"` or `"cuda"`: `quant/layouts.py`). One tensor at a time, and tensors
    used as the file has them are not copied (`gguf_plan.py`, `gguf_write.py`); the free
    space is checked before anything is written. `progress`: a bar (default: on a
    terminal). `chooser` picks each weight's layout for `kernels` (measuring this machine:
    `probes/layout_choice.LayoutChooser`, which the caller hands in); None only for
    `kernels="gguf"`, whose one layout needs no choice."""
    from transformers import AutoConfig, AutoTokenizer

    from offload.model.gguf_float import gguf_parsed_once, read_by_transformers

    chooser = _chooser_for(kernels, chooser)
    why = not_read_as_stored(source)
    if why is not None:
        raise ModelError(f"{source}: {why}; dtype='float32' (--dtype float32) converts it")
    arch, tensors = gguf_tensors(source)
    check_finite(source, tensors)  # (before a layout is timed on them, or one is written)
    with gguf_parsed_once():
        with read_by_transformers(source, "settings"):
            config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
        with read_by_transformers(source, "tokenizer"):
            tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    _hand_back_freed()  # gguf's reader: a numpy array per token and merge, freed now
    sources = _source_tensors(source, tensors, arch, config)
    descriptor = os.open(source, os.O_RDONLY)
    try:
        planned = plan(sources, lambda s: chooser.choose(s.name, LazyRows(descriptor, s), s.kind))
    finally:
        os.close(descriptor)
    check_free_space(out_dir, source, planned)
    (out_dir / "config.json").write_text(json.dumps(_settings(config, planned, chooser), indent=2))
    save_tokenizer(tokenizer, out_dir)
    del tokenizer  # (loaded again from the folder when the model runs: not held meanwhile)
    _hand_back_freed()
    write_planned(source, out_dir, planned, progress)


def _hand_back_freed() -> None:
    """Free what cycles hold and hand malloc's freed pages back: the conversion's peak is
    within the user's memory budget (a 49k-token tokenizer and gguf's parse of it take a
    share of it: docs/benchmarks.md)."""
    gc.collect()
    trim_freed_memory()


def _chooser_for(kernels: str, chooser: LayoutChoice | None) -> LayoutChoice:
    """`chooser`, or the one choice the kernels of GGUF's blocks have. A .gguf laid out for
    the CPU's or the GPU's kernels without a chooser is a caller's mistake: its layouts are
    measured, never assumed."""
    if chooser is not None:
        return chooser
    if kernels != "gguf":
        raise TypeError(
            f"laying a .gguf out for the {kernels} kernels needs a layout chooser "
            "(probes.layout_choice.LayoutChooser)"
        )
    return BlocksOnly()


def _settings(config: Any, planned: list[Planned], chooser: LayoutChoice) -> dict[str, Any]:
    """The converted folder's config.json: the model's, with what it holds as stored."""
    quantized = [p for p in planned if p.layout is not None]
    types = {p.source.name: p.source.kind for p in quantized}
    layouts = {p.source.name: p.layout for p in quantized if p.layout != QuantLayout.GGUF}
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


def _source_tensors(
    source: Path, tensors: list[HeaderTensor], arch: str, config: Any
) -> list[SourceTensor]:
    """Each tensor of the .gguf under transformers' name, with where its bytes are."""
    names = _hf_names(arch, config)
    found = []
    for tensor in tensors:
        if tensor.name not in names:
            raise ModelError(f"{source}: tensor {tensor.name!r} has no place in a {arch} model")
        heads = 0
        if _ARCHITECTURES[arch] and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            heads = config.num_attention_heads if ".attn_q." in tensor.name else _kv_heads(config)
        name = names[tensor.name]
        found.append(
            SourceTensor(name, tensor.kind, tensor.shape, tensor.offset, tensor.num_bytes, heads)
        )
    return found


def _kv_heads(config: Any) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def not_read_as_stored(source: Path) -> str | None:
    """Why the .gguf `source` cannot be read as stored (its architecture, a tensor type
    with no reader here: an IQ type, ..., or big-endian values), or None where it can;
    from the header alone (`gguf_header`, far quicker than gguf's reader:
    docs/benchmarks.md)."""
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
    with source.open("rb") as file:
        if struct.unpack("<I", file.read(8)[4:])[0] > 0xFFFF:
            return "its values are big-endian, not read as stored yet"
    return None


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
