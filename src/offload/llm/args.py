"""`LLM`'s arguments that need more than a type check: the offload settings (an
`OffloadConfig`, or vLLM's flag names beside vLLM's arguments that change nothing
here), the kind of model, and the tokenizer that goes with a model directory."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from torch import nn

from offload.config import OFFLOAD_KEYS, OffloadConfig
from offload.config.validate import flag, integer
from offload.errors import ConfigError, ModelError
from offload.llm.vllm_args import IGNORED, check_ignored
from offload.model.tokenizer import NoTokenizer, load_tokenizer
from offload.offloader.factory import as_config
from offload.planner.fit import check_swap_space


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
            f"LLM() got an unexpected argument {unknown[0]!r}; it takes {', '.join(own_names)}; "
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


class EngineLimits(NamedTuple):
    """`LLM`'s limits and host memory settings, checked."""

    max_logprobs: int  # -1: no limit, as vLLM
    max_num_seqs: int
    max_num_batched_tokens: int | None  # None: prompts prefilled whole
    trust_remote_code: bool
    swap_space_bytes: int
    kv_offload: bool  # asked for, or implied by a swap space


def engine_limits(
    *,
    tensor_parallel_size: object,
    max_logprobs: object,
    max_num_seqs: object,
    max_num_batched_tokens: object,
    trust_remote_code: object,
    swap_space: object,
    kv_offload: object,
) -> EngineLimits:
    """The limits and host memory settings, refused before anything is read or
    allocated."""
    one_device = "1 (offload runs a model on one device)"
    integer("tensor_parallel_size", tensor_parallel_size, 1, 1, what=one_device)
    logprobs = integer("max_logprobs", max_logprobs, -1)
    seqs = integer("max_num_seqs", max_num_seqs, 1)
    batched = None
    if max_num_batched_tokens is not None:
        batched = integer("max_num_batched_tokens", max_num_batched_tokens, 1)
    trusted = flag("trust_remote_code", trust_remote_code)
    swap_space_bytes = check_swap_space(swap_space)
    kv = bool(kv_offload) or swap_space_bytes > 0
    return EngineLimits(logprobs, seqs, batched, trusted, swap_space_bytes, kv)
