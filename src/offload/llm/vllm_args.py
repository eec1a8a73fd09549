"""vLLM `LLM(...)` arguments that do not apply to this engine.

Code written for vLLM passes them, so they are accepted at every value that leaves the
output unchanged here (their defaults, and values that only tune vLLM's own scheduler or
memory) and refused, by name, at a value that would change what the model computes or
needs a feature offload lacks. `LLM`'s own arguments (`trust_remote_code`,
`enforce_eager`, `max_num_seqs`, `swap_space`, ...) are real and are not listed here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from offload.config.validate import is_integer
from offload.errors import ConfigError, shown


def _any(value: object) -> bool:
    return True


def _one_of(*allowed: object) -> Callable[[object], bool]:
    return lambda value: any(value is a or (value == a and type(value) is type(a)) for a in allowed)


def _empty(value: object) -> bool:
    return value is None or (isinstance(value, Mapping | list | tuple) and not value)


# name -> (accepts(value), what the accepted values mean / why others are refused).
_SPEED_ONLY = "tunes vLLM's scheduler or memory only; ignored"
IGNORED: dict[str, tuple[Callable[[object], bool], str]] = {
    "enable_chunked_prefill": (_one_of(True, False, None), _SPEED_ONLY),
    "block_size": (lambda v: v is None or is_integer(v, 1), _SPEED_ONLY),
    "max_seq_len_to_capture": (lambda v: v is None or is_integer(v, 1), _SPEED_ONLY),
    "disable_log_stats": (_one_of(True, False), _SPEED_ONLY),
    "disable_custom_all_reduce": (_one_of(True, False), _SPEED_ONLY),
    "disable_async_output_proc": (_one_of(True, False), _SPEED_ONLY),
    "distributed_executor_backend": (_one_of(None, "mp", "uni"), "ranks run as processes"),
    "data_parallel_size": (_one_of(1), "replicas run behind `offload serve --data-parallel-size`"),
    "kv_cache_dtype": (_one_of("auto"), "the KV cache is kept in the model's dtype"),
    "calculate_kv_scales": (_one_of(False), "the KV cache is kept in the model's dtype"),
    "revision": (_one_of(None, "main"), "give a local folder or the cached snapshot instead"),
    "tokenizer_revision": (_one_of(None, "main"), "give a local tokenizer folder instead"),
    "code_revision": (_one_of(None, "main"), "give a local folder instead"),
    "tokenizer_mode": (_one_of("auto", "hf"), "the tokenizer is transformers' AutoTokenizer"),
    "hf_token": (_any, "used only to download; local files need none"),
    "hf_overrides": (_empty, "the checkpoint's config.json is used as it is"),
    "enable_lora": (_one_of(False), "LoRA adapters are not supported"),
    "max_loras": (_any, "LoRA adapters are not supported (enable_lora=False)"),
    "max_lora_rank": (_any, "LoRA adapters are not supported (enable_lora=False)"),
    "task": (_one_of("auto", "generate"), "offload's LLM generates text"),
    "runner": (_one_of("auto", "generate"), "offload's LLM generates text"),
    "convert": (_one_of("auto", "none"), "offload's LLM generates text"),
    "compilation_config": (
        _empty,
        "decode runs compiled (CUDA graphs on a GPU) unless enforce_eager",
    ),
    "mm_processor_kwargs": (_empty, "text models only"),
    "limit_mm_per_prompt": (_empty, "text models only"),
    "allowed_local_media_path": (_one_of(""), "text models only"),
    "enable_sleep_mode": (_one_of(False), "not supported"),
    "logits_processors": (_empty, "use SamplingParams' fields"),
}


def check_ignored(args: Mapping[str, Any]) -> None:
    """Refuse, by name, a vLLM argument whose value would change something here."""
    for name, value in args.items():
        accepts, meaning = IGNORED[name]
        if not accepts(value):
            raise ConfigError(f"LLM(): {name}={shown(value)} is not supported ({meaning})")
