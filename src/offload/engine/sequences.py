"""A request's sequences while they decode, the batch they form, and what `generate`
returns (vLLM's `RequestOutput` and `CompletionOutput`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from offload.engine.detokenize import Window
from offload.engine.logprobs import Logprob
from offload.engine.sampling import TokenCounts
from offload.engine.sampling_params import SamplingParams
from offload.errors import ConfigError

if TYPE_CHECKING:
    from offload.engine.grammars import GrammarState


@dataclass
class CompletionOutput:
    """One generated sequence (vLLM's names)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" (end token or stop string) or "length"
    stop_reason: int | str | None = None  # the stop token id or stop string, if any
    cumulative_logprob: float | None = None  # with `logprobs`: the sum over token_ids
    logprobs: list[dict[int, Logprob]] | None = None  # with `logprobs`: one per token id


@dataclass
class RequestOutput:
    """What `generate` returns for one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    # With `prompt_logprobs`: one entry per prompt token, None for the first.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class Batch:
    """The sequences as one left-padded batch: prompts right-aligned at `width`."""

    input_ids: torch.Tensor  # [batch, width]
    starts: torch.Tensor  # [batch]: where each prompt begins
    columns: torch.Tensor  # [cache length]
    mask: torch.Tensor  # [batch, cache length]: 1 where a real token is
    width: int
    length: int  # prompt width plus the longest output a row may have

    @staticmethod
    def length_of(sequences) -> int:
        """Prompt width plus the longest output a row may have."""
        return max(len(s.prompt_ids) for s in sequences) + max(s.limit for s in sequences)

    @classmethod
    def of(cls, sequences, pad: int | None, device, room=lambda length: length) -> Batch:
        """`room` gives the cache's length for `length` positions (a compiled step's
        cache is rounded up, so that few shapes serve every prompt)."""
        width = max(len(s.prompt_ids) for s in sequences)
        length = width + max(s.limit for s in sequences)
        rows = [[pad or 0] * (width - len(s.prompt_ids)) + s.prompt_ids for s in sequences]
        starts = torch.tensor([width - len(s.prompt_ids) for s in sequences], device=device)
        columns = torch.arange(room(length), device=device)
        mask = ((columns[None, :] >= starts[:, None]) & (columns[None, :] < width)).long()
        input_ids = torch.tensor(rows, device=device)
        return cls(input_ids, starts, columns, mask, width, length)


@dataclass
class SequenceState:
    """One sequence of a request (a request with `n` > 1 has n of them)."""

    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    limit: int  # new tokens it may have: max_tokens, and prompt + output <= max_model_len
    counts: TokenCounts | None = None  # what the penalties read, when the request has any
    is_first: bool = True  # the first of its request's n: it carries the prompt logprobs
    request: int = 0  # which prompt of the call it answers
    bad_ids: list[list[int]] = field(default_factory=list)  # bad words' token sequences
    grammar: GrammarState | None = None  # with structured outputs: its own matcher
    tokens: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    text: str = ""
    window: Window | None = None  # where decoding its text stands (`detokenize`)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Preempted: how many of its tokens a decode step computed as a prefill would (their
    # keys and values are then recomputed by a prefill on resuming, not replayed)
    exact_tokens: int = 0

    @property
    def to_go(self) -> int:
        """Tokens it may still take."""
        return self.limit - len(self.tokens)


class RequestProgress:
    """vLLM's "Processed prompts" bar: a prompt counts once all its sequences are done.
    `use_tqdm` is True, False or a tqdm-like class to draw it with."""

    def __init__(self, sequences: list[SequenceState], use_tqdm: bool | Callable):
        self._sequences = sequences
        self._total = len({s.request for s in sequences})
        self._done = 0
        self._bar = None
        if use_tqdm and self._total:
            from tqdm import tqdm

            make = use_tqdm if callable(use_tqdm) else tqdm
            self._bar = make(total=self._total, desc="Processed prompts", dynamic_ncols=True)

    def update(self) -> None:
        if self._bar is None:
            return
        open_requests = {s.request for s in self._sequences if s.finish_reason is None}
        done = self._total - len(open_requests)
        self._bar.update(done - self._done)
        self._done = done

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def completion_of(index: int, sequence: SequenceState) -> CompletionOutput:
    wants = sequence.params.logprobs is not None
    return CompletionOutput(
        index,
        sequence.text,
        sequence.tokens,
        sequence.finish_reason,
        sequence.stop_reason,
        cumulative_logprob=(
            sum(
                entry[t].logprob
                for entry, t in zip(sequence.logprobs, sequence.tokens, strict=True)
            )
            if wants
            else None
        ),
        logprobs=sequence.logprobs if wants else None,
    )


def per_prompt(sampling_params, count: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    allowed = f"sampling_params must be one SamplingParams or one per prompt ({count})"
    if isinstance(sampling_params, str | bytes | Mapping) or not isinstance(
        sampling_params, Iterable
    ):
        raise ConfigError(f"{allowed}, got {type(sampling_params).__name__}")
    params = list(sampling_params)
    wrong = next((p for p in params if not isinstance(p, SamplingParams)), None)
    if wrong is not None:
        raise ConfigError(f"{allowed}, got a list holding a {type(wrong).__name__}")
    if len(params) != count:
        raise ConfigError(f"{allowed}, got {len(params)}")
    return params
