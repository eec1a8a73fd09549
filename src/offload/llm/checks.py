"""Checks of what `LLM`, `LLM.generate` and `LLM.chat` are given, made before any work:
a bad argument is one line naming it, the value and what is allowed, never a foreign
exception from deeper down (torch, jinja2, Python's own TypeError)."""

from __future__ import annotations

import functools
import operator
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from offload.config.limits import SEED_RANGE
from offload.config.validate import flag, integer
from offload.engine import invariant
from offload.errors import ConfigError, ModelError, shown
from offload.llm.fit import check_swap_space
from offload.memory.placement import AUTO
from offload.memory.threads import check_not_forked
from offload.model.build import DTYPES
from offload.model.loader import LOAD_FORMATS
from offload.planner.fit import check_budget_args

PROMPT_FORMS = "a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}"
PROMPT_KEYS = ("prompt", "prompt_token_ids")


# -- LLM(...) ---------------------------------------------------------------------


def check_llm_args(
    *,
    model: object,
    tokenizer: object,
    dtype: object,
    max_model_len: object,
    gpu_memory_utilization: object,
    device_memory_gb: object,
    seed: object,
    load_format: object,
    kv_offload: object,
    enforce_eager: object,
    progress: object,
    tensor_parallel_size: object,
    pipeline_parallel_size: object,
    max_logprobs: object,
    max_num_seqs: object,
    max_num_batched_tokens: object,
    trust_remote_code: object,
    swap_space: object,
    kv_cache_memory_bytes: object = None,
    pipeline_micro_batches: object = None,
) -> EngineLimits:
    """The types and ranges of `LLM`'s own arguments that need no model to check, so a
    bad one is refused before anything is read or allocated; returns the limits and host
    memory settings they give."""
    _check_path("model", model)
    _check_path("tokenizer", tokenizer)
    named = isinstance(dtype, str) and (dtype == AUTO or dtype in DTYPES)
    if not named and not (isinstance(dtype, torch.dtype) and dtype in DTYPES.values()):
        raise ModelError(f"dtype must be auto, {', '.join(DTYPES)}; got {shown(dtype)}")
    if not isinstance(load_format, str) or load_format not in LOAD_FORMATS:
        raise ModelError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {shown(load_format)}"
        )
    if max_model_len is not None:
        what = "an integer >= 1 (or None: the model's own limit)"
        integer("max_model_len", max_model_len, 1, what=what)
    check_budget_args(gpu_memory_utilization, device_memory_gb)
    integer("seed", seed, *SEED_RANGE)
    flag("kv_offload", kv_offload)
    flag("enforce_eager", enforce_eager)
    if progress is not None:
        flag("progress", progress, "True, False or None (a bar when stderr is a terminal)")
    one_device = "1 (offload runs a model on one device)"
    integer("tensor_parallel_size", tensor_parallel_size, 1, 1, what=one_device)
    what = "an integer >= 1 (ranks, each holding a stage of the decoder layers)"
    integer("pipeline_parallel_size", pipeline_parallel_size, 1, what=what)
    if pipeline_micro_batches is not None:
        what = "an integer >= 1 (or None: one per pipeline rank)"
        integer("pipeline_micro_batches", pipeline_micro_batches, 1, what=what)
    logprobs = integer("max_logprobs", max_logprobs, -1)
    seqs = integer("max_num_seqs", max_num_seqs, 1)
    batched = None
    if max_num_batched_tokens is not None:
        batched = integer("max_num_batched_tokens", max_num_batched_tokens, 1)
    trusted = flag("trust_remote_code", trust_remote_code)
    swap_space_bytes = check_swap_space(swap_space)
    kv = bool(kv_offload) or swap_space_bytes > 0
    kv_bytes = None
    if kv_cache_memory_bytes is not None:  # (vLLM's: the KV cache's size, not a share)
        what = "a number of bytes >= 1 (or None: sized from the memory there is)"
        kv_bytes = integer("kv_cache_memory_bytes", kv_cache_memory_bytes, 1, what=what)
    return EngineLimits(logprobs, seqs, batched, trusted, swap_space_bytes, kv, kv_bytes)


class EngineLimits(NamedTuple):
    """`LLM`'s limits and host memory settings, checked."""

    max_logprobs: int  # -1: no limit, as vLLM
    max_num_seqs: int
    max_num_batched_tokens: int | None  # None: prompts prefilled whole
    trust_remote_code: bool
    swap_space_bytes: int
    kv_offload: bool  # asked for, or implied by a swap space
    kv_cache_memory_bytes: int | None = None  # the KV cache's size (serving; a budget's share)


def _check_path(name: str, value: object) -> None:
    if value is None:
        return
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{name} must be a model directory (a str or Path), got {shown(value)}")


# -- generate(prompts) ------------------------------------------------------------


def parse_prompts(
    prompts: object, encode: Callable[[str], list[int]]
) -> tuple[list[str | None], list[list[int]], list[bool]]:
    """The text, token ids and whether the ids came from the tokenizer, of each prompt.
    `prompts` is one prompt or any iterable of them (a list, a tuple, a generator)."""
    if isinstance(prompts, str | Mapping):
        prompts = [prompts]
    elif isinstance(prompts, bytes | bytearray) or not isinstance(prompts, Iterable):
        raise ConfigError(f"prompts must be {PROMPT_FORMS} or a list of them, got {shown(prompts)}")
    texts, ids, encoded = [], [], []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            text, tokens = prompt, None
        elif isinstance(prompt, Mapping):
            text, tokens = _prompt_dict(index, prompt)
        else:
            raise ConfigError(f"a prompt must be {PROMPT_FORMS}; prompt {index} is {shown(prompt)}")
        if text is not None:
            check_text(text, f"prompt {index}")
        texts.append(text)
        encoded.append(tokens is None)
        ids.append(encode(text) if tokens is None else tokens)
    return texts, ids, encoded


def check_text(text: str, where: str) -> None:
    """Text a tokenizer can take: Unicode that UTF-8 can encode (not a lone surrogate,
    as a bad decode of bytes leaves)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ConfigError(
            f"{where} is not valid text: {error.reason} at character {error.start} "
            f"({error.object[error.start : error.end]!r})"
        ) from None


def _prompt_dict(index: int, prompt: Mapping) -> tuple[str | None, list[int] | None]:
    unknown = [key for key in prompt if key not in PROMPT_KEYS]
    if unknown:
        raise ConfigError(
            f"a prompt dict has the keys {', '.join(PROMPT_KEYS)}; prompt {index} has "
            f"{shown(unknown[0])}"
        )
    text = prompt.get("prompt")
    if "prompt_token_ids" not in prompt and not isinstance(text, str):
        raise ConfigError(f"a prompt must be {PROMPT_FORMS}; prompt {index} is {shown(prompt)}")
    if text is not None and not isinstance(text, str):
        raise ConfigError(f"prompt {index}'s 'prompt' must be a string, got {shown(text)}")
    if "prompt_token_ids" not in prompt:
        return text, None
    return text, _token_ids(index, prompt["prompt_token_ids"])


def _token_ids(index: int, value: object) -> list[int]:
    error = ConfigError(
        f"prompt_token_ids must be a list of integer token ids, got {shown(value)} (prompt {index})"
    )
    if isinstance(value, str | bytes | bytearray | Mapping) or not isinstance(value, Iterable):
        raise error
    tokens = []
    for token in value:
        if isinstance(token, bool):
            raise error
        try:  # numpy and torch integers are ids too, as in vLLM
            tokens.append(operator.index(token))
        except TypeError:
            raise error from None
    return tokens


def vocab_limit(model: nn.Module) -> int:
    """The token ids the model can embed and predict: [0, this)."""
    limit = model.config.vocab_size
    try:
        embeddings = model.get_input_embeddings()
    except NotImplementedError:  # transformers' answer for a model that does not say
        return limit
    rows = getattr(embeddings, "num_embeddings", None)
    return limit if rows is None else min(limit, rows)


def check_token_ids(ids: Sequence[list[int]], vocab: int, encoded: Sequence[bool]) -> None:
    """Every prompt's ids within the vocabulary, checked before any forward: an id the
    embedding does not have is torch's IndexError (or a device assert) otherwise."""
    for index, (tokens, from_text) in enumerate(zip(ids, encoded, strict=True)):
        bad = next((token for token in tokens if not 0 <= token < vocab), None)
        if bad is not None:
            why = " (the tokenizer's vocabulary is larger than the model's)" if from_text else ""
            raise ConfigError(
                f"prompt {index} holds a token id the model cannot embed{why}: "
                f"token ids in [0, {vocab}), got {shown(bad)}"
            )


def check_use_tqdm(use_tqdm: object) -> None:
    if not isinstance(use_tqdm, bool) and not callable(use_tqdm):
        raise ConfigError(
            f"use_tqdm must be True, False or a tqdm-like class, got {shown(use_tqdm)}"
        )


def serialized(method: Callable) -> Callable:
    """One call at a time per `LLM`: the offloaded weights' device slots, the KV cache and
    the counters belong to one forward at a time, so a second thread's call waits for
    the first to finish (each gets exactly the tokens it would get alone)."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        check_not_forked(self._pid, "this LLM")
        with self._lock:
            if self._closed:
                raise ConfigError("this LLM is closed; make a new LLM(...) to generate again")
            return method(self, *args, **kwargs)

    return call


def prefix_caching_of(value: object, invariant: bool) -> bool:
    """`enable_prefix_caching` checked; None: on, as in vLLM's V1 engine, except in
    batch-invariant mode (a held prefix was computed in another forward than the one the
    request alone would run, so its numbers could differ)."""
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"enable_prefix_caching must be True or False, got {value!r}")
    if value and invariant:
        raise ConfigError(
            "enable_prefix_caching=True with batch_invariant: a reused prefix was computed "
            "beside other tokens, so a request's numbers would depend on earlier ones"
        )
    return not invariant if value is None else value


def batch_invariant_of(value: object, kv_offload: bool) -> bool:
    """`batch_invariant` checked; None: vLLM's VLLM_BATCH_INVARIANT=1 decides, as there."""
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"batch_invariant must be True or False, got {value!r}")
    on = invariant.from_env() if value is None else value
    if on and kv_offload:
        raise ConfigError(
            "batch_invariant is not measured with the KV cache in host memory yet: "
            "leave kv_offload and swap_space unset with it"
        )
    return on
