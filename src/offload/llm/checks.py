"""Checks of what `LLM`, `LLM.generate` and `LLM.chat` are given, made before any work:
a bad argument is one line naming it, the value and what is allowed, never a foreign
exception from deeper down (torch, jinja2, Python's own TypeError)."""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from offload.config.limits import SEED_RANGE
from offload.config.validate import flag, integer
from offload.errors import ConfigError, ModelError, shown
from offload.model.build import DTYPES
from offload.model.loader import LOAD_FORMATS
from offload.planner.fit import check_budget_args

PROMPT_FORMS = "a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}"
PROMPT_KEYS = ("prompt", "prompt_token_ids")
# apply_chat_template's own arguments and the variables it gives the template: set
# through chat_template_kwargs they would clash with chat()'s (Python's TypeError).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


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
) -> None:
    """The types and ranges of `LLM`'s own arguments that need no model to check, so a
    bad one is refused before anything is read or allocated."""
    _check_path("model", model)
    _check_path("tokenizer", tokenizer)
    named = isinstance(dtype, str) and (dtype == "auto" or dtype in DTYPES)
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
        texts.append(text)
        encoded.append(tokens is None)
        ids.append(encode(text) if tokens is None else tokens)
    return texts, ids, encoded


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


# -- chat(messages) ---------------------------------------------------------------


def conversations_of(messages: object) -> list[list[Mapping[str, Any]]]:
    """One conversation (a list of messages) or a list of them, each checked: a message
    is a dict with a string 'role' and a 'content' (a string or a list of parts)."""
    if isinstance(messages, str | bytes | bytearray | Mapping) or not isinstance(
        messages, Sequence
    ):
        raise ConfigError(
            "messages must be a conversation (a list of {'role': str, 'content': str} "
            f"dicts) or a list of conversations, got {shown(messages)}"
        )
    if not messages:  # no conversations, as vLLM (and generate([])) answer []
        return []
    if isinstance(messages[0], Mapping):
        _check_conversation("messages", messages)
        return [list(messages)]
    for index, conversation in enumerate(messages):
        _check_conversation(f"messages[{index}]", conversation)
    return [list(conversation) for conversation in messages]


def _check_conversation(where: str, conversation: object) -> None:
    if isinstance(conversation, str | bytes | bytearray | Mapping) or not isinstance(
        conversation, Sequence
    ):
        raise ConfigError(
            f"{where} must be a list of {{'role', 'content'}} dicts, got {shown(conversation)}"
        )
    if not conversation:
        raise ConfigError(f"{where} is an empty conversation; it needs at least one message")
    for number, message in enumerate(conversation):
        _check_message(f"{where}[{number}]", message)


def _check_message(where: str, message: object) -> None:
    if not isinstance(message, Mapping):
        raise ConfigError(f"{where} must be a dict with 'role' and 'content', got {shown(message)}")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ConfigError(f"{where}['role'] must be a string such as 'user', got {shown(role)}")
    content = message.get("content")
    # A message that calls tools may have no text (OpenAI's format).
    if content is None and message.get("tool_calls"):
        return
    parts_ok = isinstance(content, list) and all(isinstance(p, Mapping) for p in content)
    if not isinstance(content, str) and not parts_ok:
        raise ConfigError(
            f"{where}['content'] must be a string or a list of content parts (dicts), "
            f"got {shown(content)}"
        )


def check_chat_args(
    chat_template: object,
    add_generation_prompt: object,
    continue_final_message: object,
    tools: object,
    chat_template_kwargs: object,
) -> None:
    if chat_template is not None and (not isinstance(chat_template, str) or not chat_template):
        raise ConfigError(
            f"chat_template must be a Jinja template string, got {shown(chat_template)}"
        )
    flag("add_generation_prompt", add_generation_prompt)
    flag("continue_final_message", continue_final_message)
    if tools is not None and (
        isinstance(tools, str | bytes | Mapping)
        or not isinstance(tools, Sequence)
        or not all(isinstance(tool, Mapping) or callable(tool) for tool in tools)
    ):
        raise ConfigError(
            f"tools must be a list of tool definitions (dicts or functions), got {shown(tools)}"
        )
    if chat_template_kwargs is None:
        return
    if not isinstance(chat_template_kwargs, Mapping) or not all(
        isinstance(key, str) for key in chat_template_kwargs
    ):
        raise ConfigError(
            "chat_template_kwargs must be a dict of template variables by name, "
            f"got {shown(chat_template_kwargs)}"
        )
    clash = sorted(RESERVED_TEMPLATE_KWARGS.intersection(chat_template_kwargs))
    if clash:
        raise ConfigError(
            f"chat_template_kwargs may not set {clash[0]!r}: chat() sets it itself "
            "(pass it as chat()'s own argument where there is one)"
        )


def render_chat(tokenizer, conversations: list[list[Mapping[str, Any]]], **options) -> list[str]:
    """Each conversation through the chat template (`options`: apply_chat_template's).
    The template is the user's code: what it raises is the user's error, one line with
    the template's own first line of reason."""
    from jinja2 import TemplateError

    texts = []
    for index, conversation in enumerate(conversations):
        try:
            text = tokenizer.apply_chat_template(conversation, tokenize=False, **options)
        # A template does arithmetic, indexing and string work on what it is given:
        # these are what that raises (jinja2's own errors, and Python's from inside it).
        except (
            TemplateError,
            TypeError,
            ValueError,
            ArithmeticError,
            LookupError,
            AttributeError,
        ) as error:
            raise ConfigError(
                f"the chat template failed on conversation {index}: {_reason(error)}"
            ) from None
        texts.append(text)
    return texts


def _reason(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    reason = f"{type(error).__name__}: {lines[0] if lines else 'no message'}"
    line = getattr(error, "lineno", None)
    return f"{reason} (template line {line})" if line else reason
