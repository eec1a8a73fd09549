"""The sizes a model config may ask for, checked before transformers builds anything.

Building even an empty (meta) model takes time per layer (docs/benchmarks.md, "Loading"),
and some configs build lists as long as their layer count, so a config.json
with `num_hidden_layers: 1000000000` would hang the process, or exhaust its memory, long
before any weight is read. Each limit is far above the published models (the deepest have
about 130 layers, the widest a hidden size of about 25k, the largest vocabularies about
260k tokens, the most experts 512, the most parameters about 2 T) and far below sizes that
take minutes or all memory to build.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from offload.errors import ModelError

MAX_LAYERS = 4096  # an empty model this deep still builds in seconds, not minutes
MAX_HIDDEN = 1 << 20
MAX_INTERMEDIATE = 1 << 22
MAX_VOCAB = 1 << 24
MAX_HEADS = 1 << 16  # also the limit of a head's size
MAX_POSITIONS = 1 << 24  # Llama 4 Scout, the longest context, has 10 M (about 1 << 23.3)
MAX_EXPERTS = 1 << 13
MAX_PARAMETERS = 10 * 10**12  # 20 TB in bfloat16: more than any machine's memory and disk

# The keys each size goes under in the config.json of some architecture, and their limit.
_SIZES = {
    ("layers", MAX_LAYERS): (
        "num_hidden_layers",
        "n_layer",
        "n_layers",
        "num_layers",
        "num_decoder_layers",
        "num_encoder_layers",
        "decoder_layers",
        "encoder_layers",
    ),
    ("hidden size", MAX_HIDDEN): ("hidden_size", "n_embd", "d_model", "word_embed_proj_dim"),
    ("intermediate size", MAX_INTERMEDIATE): (
        "intermediate_size",
        "n_inner",
        "ffn_dim",
        "d_ff",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "decoder_ffn_dim",
        "encoder_ffn_dim",
    ),
    ("vocabulary size", MAX_VOCAB): ("vocab_size",),
    ("heads", MAX_HEADS): (
        "num_attention_heads",
        "num_key_value_heads",
        "n_head",
        "n_heads",
        "num_heads",
        "encoder_attention_heads",
        "decoder_attention_heads",
        "head_dim",
        "d_kv",
    ),
    ("positions", MAX_POSITIONS): ("max_position_embeddings", "n_positions", "n_ctx"),
    ("experts", MAX_EXPERTS): (
        "num_local_experts",
        "num_experts",
        "n_routed_experts",
        "moe_num_experts",
        "num_experts_per_tok",
    ),
}
_LIMITS = {key: (what, limit) for (what, limit), keys in _SIZES.items() for key in keys}


def size_limit(key: str) -> tuple[str, int]:
    """What the size setting `key` (a config.json name: "num_hidden_layers") counts, and
    its limit."""
    return _LIMITS[key]


def check_sizes(settings: dict[str, Any], config_file: Path) -> None:
    """Refuse a size beyond its limit anywhere in the raw settings (nested configs, such
    as a multimodal model's text_config, included), before transformers reads them."""
    for key, value in _numbers(settings):
        what, limit = _LIMITS[key]
        if value > limit:
            raise ModelError(
                f"{config_file}: {key}={value} is too large (the limit for {what} is {limit})"
            )


def _numbers(settings: dict[str, Any]) -> Iterator[tuple[str, int | float]]:
    """The numeric values under the size keys, depth first. Iterative: a config nested as
    deep as the JSON parser allows must not exhaust the stack here."""
    pending = [settings]
    while pending:
        current = pending.pop()
        for key, value in current.items():
            if isinstance(value, dict):
                pending.append(value)
            elif key in _LIMITS and isinstance(value, int | float) and not isinstance(value, bool):
                yield key, value


def check_parameters(hf_config: Any, config_file: Path) -> None:
    """Refuse settings whose parameter count, roughly estimated, is beyond
    `MAX_PARAMETERS` (each size alone may be within its limit)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    layers, hidden, intermediate, vocab = (
        _size(text, name)
        for name in ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size")
    )
    intermediate = intermediate or 4 * hidden
    experts = max(_size(text, n) for n in ("num_local_experts", "num_experts", "n_routed_experts"))
    expert_intermediate = _size(text, "moe_intermediate_size") or intermediate
    # Attention's query and output projections, the MLP's up and down projections (or
    # gate, up and down of each expert), and the embedding: a floor for decoder models.
    per_layer = 2 * hidden * hidden + 2 * hidden * intermediate
    per_layer += experts * 3 * hidden * expert_intermediate
    parameters = layers * per_layer + vocab * hidden
    if parameters > MAX_PARAMETERS:
        raise ModelError(
            f"{config_file}: num_hidden_layers={layers}, hidden_size={hidden}, "
            f"intermediate_size={intermediate}, vocab_size={vocab}"
            + (f", {experts} experts" if experts else "")
            + f" make about {parameters:.2g} parameters, beyond the limit of "
            f"{MAX_PARAMETERS:.0g} (more than any machine's memory and disk hold)"
        )


def _size(config: Any, name: str) -> int:
    """A size setting as an int, 0 when absent or not a single number (a per-layer list)."""
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
