"""`LLM`'s arguments that need more than a type check: the offload settings (an
`OffloadConfig`, or vLLM's flag names beside vLLM's arguments that change nothing
here), the kind of model, and the tokenizer that goes with a model directory."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import nn

from offload.config import OFFLOAD_KEYS, Backend, OffloadConfig
from offload.errors import ConfigError, ModelError, did_you_mean
from offload.llm.vllm_args import IGNORED, check_ignored
from offload.model.tokenizer import NoTokenizer, load_tokenizer
from offload.offloader.factory import as_config


def tokenizer_of(path: Path, tokenizer, load_format: str, trust_remote_code: bool):
    """The tokenizer; a dummy model from a bare config.json (a shipped shape) has none."""
    folder = Path(tokenizer) if tokenizer is not None else path
    bare = not any(
        (folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
    )
    if load_format == "dummy" and tokenizer is None and bare:
        return NoTokenizer()
    return load_tokenizer(folder, trust_remote_code)


def offload_config_of(
    offload_config: OffloadConfig | Mapping[str, Any] | None,
    flags: dict[str, Any],
    own_names: list[str],
) -> OffloadConfig:
    """The offload settings, from `offload_config` or from vLLM's flag names in `flags`
    (not both); vLLM's arguments that change nothing here are checked and dropped, and
    any other name is refused, listing `own_names` (`LLM`'s own arguments) too."""
    ignored = {key: flags.pop(key) for key in list(flags) if key in IGNORED}
    unknown = [key for key in flags if key not in OFFLOAD_KEYS]
    if unknown:
        raise ConfigError(
            f"LLM() got an unexpected argument {unknown[0]!r}"
            f"{did_you_mean(unknown[0], [*own_names, *OFFLOAD_KEYS])}; it takes {', '.join(own_names)}; "
            f"the offload flags {', '.join(OFFLOAD_KEYS)}; and, at values that change "
            f"nothing here, vLLM's {', '.join(IGNORED)}"
        )
    check_ignored(ignored)
    if offload_config is not None and flags:
        raise ConfigError("pass offload settings either as offload_config or as flags, not both")
    return as_config(offload_config if offload_config is not None else flags)


def check_attention_model(empty: nn.Module) -> None:
    """Refuse a model that keeps a recurrent state instead of a KV cache."""
    if getattr(empty, "_is_stateful", False):
        raise ModelError(
            f"LLM runs attention models with a KV cache; {type(empty).__name__} keeps a "
            "recurrent state (offload.apply still offloads its layers for model.generate)"
        )


def as_run(config: OffloadConfig) -> OffloadConfig:
    """`config` with `offload_backend="auto"` named as the backend that runs (what
    `llm.offload_config` shows); as it is where nothing is offloaded, or where the name
    alone would not validate (the disk tier without a prefetch group)."""
    backend = config.selected_backend
    if config.offload_backend != Backend.AUTO or backend == Backend.NONE:
        return config
    try:
        return replace(config, offload_backend=backend)
    except ConfigError:
        return config
