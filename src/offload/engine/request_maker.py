"""A prompt and its `SamplingParams` made into sequences, checked once: the one place where
`generate`, `chat`, `stream` and `serve` learn whether a prompt fits and how many tokens
its answer may have."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from offload.engine.grammars import Grammars, GrammarState
from offload.engine.requests import Emit, Submitted
from offload.engine.sampling import TokenCounts, bad_words_token_ids, make_generator
from offload.engine.sampling_params import SamplingParams
from offload.engine.sequences import SequenceState
from offload.errors import ConfigError


@dataclass(frozen=True)
class RequestMaker:
    """Checks and sequences for one model: its context (`max_model_len`), vocabulary,
    `max_logprobs` (-1: any) and the device its sampling runs on."""

    max_model_len: int
    vocab_size: int
    max_logprobs: int
    device: torch.device
    encode: Callable[[str], list[int]]  # (a bad word's tokens)
    grammars: Grammars | None = None  # (structured outputs' compiler)

    def truncate(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` tokens (-1: room for one new token)."""
        keep = params.truncate_prompt_tokens
        if keep is None:
            return prompt_ids
        return prompt_ids[-(self.max_model_len - 1 if keep == -1 else keep) :]

    def check(self, prompt_ids: list[int], params: SamplingParams, max_len: int | None = None):
        """That the prompt fits `max_len` positions (default: `max_model_len`; a server's
        rows may be shorter) with room for one new token, that every token id the
        request names is in the vocabulary, and that it asks for no more logprobs than
        allowed."""
        max_len = max_len or self.max_model_len
        if not prompt_ids or len(prompt_ids) >= max_len:
            raise ConfigError(
                f"a prompt has {len(prompt_ids)} tokens; it must have 1 to {max_len - 1} "
                f"(max_model_len={max_len})"
            )
        for name, tokens in params.token_ids_named().items():
            if any(token >= self.vocab_size for token in tokens):
                raise ConfigError(
                    f"{name} must hold token ids below the vocabulary size {self.vocab_size}, "
                    f"got {max(tokens)}"
                )
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            num = self.vocab_size if asked == -1 else asked
            if num is not None and self.max_logprobs != -1 and num > self.max_logprobs:
                raise ConfigError(
                    f"{name}={asked} asks for {num} log-probabilities per token; at most "
                    f"max_logprobs={self.max_logprobs} are allowed (set LLM(max_logprobs=...))"
                )

    def sequences(
        self, prompt_ids: list[int], params: SamplingParams, index: int, max_len: int | None = None
    ) -> list[SequenceState]:
        """The request's `n` sequences (they share its generator), each allowed
        `max_tokens` new tokens or what `max_len` positions leave the prompt, the fewer
        (the one clamp); `index`: the request's number in its call."""
        room = (max_len or self.max_model_len) - len(prompt_ids)
        limit = room if params.max_tokens is None else min(params.max_tokens, room)
        generator = make_generator(params, self.device)
        bad_ids = bad_words_token_ids(params.bad_words or [], self.encode)
        compiled = self._compiled(params)
        sequences = []
        for number in range(params.n):
            counts = (
                TokenCounts(prompt_ids, self.vocab_size, self.device)
                if params.has_penalties
                else None
            )
            sequence = SequenceState(prompt_ids, params, generator, limit, counts)
            sequence.is_first, sequence.request, sequence.bad_ids = number == 0, index, bad_ids
            if compiled is not None:  # (each of the n its own place in the grammar)
                sequence.grammar = GrammarState(compiled)
            sequences.append(sequence)
        return sequences

    def _compiled(self, params: SamplingParams):
        """The request's compiled grammar (None: it asks for none)."""
        if params.structured_outputs is None:
            return None
        if self.grammars is None:
            raise ConfigError("structured outputs are not available here: no tokenizer")
        return self.grammars.compile(params.structured_outputs)

    def request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        emit: Emit,
        index: int = 0,
        max_len: int | None = None,
    ) -> Submitted:
        """One request for an engine core: its prompt truncated as asked, checked, and its
        sequences made (`index`: its number in a call of several; `max_len`: the positions
        a row holds, default `max_model_len`)."""
        prompt_ids = self.truncate(prompt_ids, params)
        self.check(prompt_ids, params, max_len)
        sequences = self.sequences(prompt_ids, params, index, max_len)
        return Submitted(request_id, prompt, prompt_ids, sequences, emit)
