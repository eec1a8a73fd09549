"""Around each sampled token: before the pick, the raw log-probabilities and the tokens a
row may not pick; after it, the penalties' counts, the text, and whether the sequence ends."""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch

from offload.engine.detokenize import Detokenizer
from offload.engine.grammars import mask_logits
from offload.engine.logprobs import log_softmax, prompt_logprobs, token_logprobs
from offload.engine.sampling import banned_tokens, find_stop, sample
from offload.engine.sequences import SequenceState
from offload.errors import NonFiniteLogits


class TokenSteps:
    """The per-token work of the decode loop, for one tokenizer and its end ids."""

    def __init__(self, tokenizer, eos_ids: Collection[int]):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.detokenizer = Detokenizer(tokenizer)
        # What names the checkpoint's tensor that holds nan or inf, where non-finite logits
        # meet it (None: the guard's message as it is); set by whoever loads the model.
        self.damage: Callable[[], str | None] | None = None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def pick(self, logits: torch.Tensor, sequences: list[SequenceState]) -> torch.Tensor:
        """Each row's next token from logits [batch, vocab] (changed in place by the bans);
        the unfinished sequences take theirs. Returns the tokens [batch]."""
        # Grammars first, and the logprobs after them, as vLLM: its runner masks the
        # logits before its sampler takes their logprobs (its default logprobs_mode,
        # "raw_logprobs": before penalties, bans and temperature, after the grammar).
        mask_logits(logits, [s.grammar if s.finish_reason is None else None for s in sequences])
        raw = self._raw_logprobs(logits, sequences)  # before the rest changes the logits
        self._ban(logits, sequences)
        try:
            tokens = sample(
                logits,
                [s.params for s in sequences],
                [s.generator for s in sequences],
                [s.counts for s in sequences],
                [s.request for s in sequences],
            )
        except NonFiniteLogits as error:
            found = self.damage() if self.damage is not None else None
            if found is None:
                raise
            raise NonFiniteLogits(f"{error.args[0].split(':')[0]}: {found}") from None
        for row, (sequence, token) in enumerate(zip(sequences, tokens.tolist(), strict=True)):
            if sequence.finish_reason is None:
                if row in raw:
                    num = sequence.params.logprobs
                    sequence.logprobs.append(token_logprobs(raw[row], token, num, self._text))
                if sequence.counts is not None:
                    sequence.counts.add(token)
                self._advance(sequence, token)
                self._append(sequence, token)
                grammar = sequence.grammar
                if grammar is not None and grammar.is_terminated and not sequence.finish_reason:
                    sequence.finish_reason = "stop"  # (its stop token taken with ignore_eos)
        return tokens

    def prompt_logprobs(
        self, logits: torch.Tensor, sequences: list[SequenceState], width: int
    ) -> None:
        """Each request's prompt logprobs from the prefill's logits [batch, width, vocab]
        (the prompt is right-aligned in its row)."""
        for row, sequence in enumerate(sequences):
            num = sequence.params.prompt_logprobs
            if num is not None and sequence.is_first:
                start = width - len(sequence.prompt_ids)
                sequence.prompt_logprobs = prompt_logprobs(
                    logits[row, start:], sequence.prompt_ids, num, self._text
                )

    def _raw_logprobs(self, logits: torch.Tensor, sequences: list[SequenceState]) -> dict:
        """Row -> log-probabilities [vocab] for the unfinished rows that want them."""
        return {
            row: log_softmax(logits[row])
            for row, s in enumerate(sequences)
            if s.params.logprobs is not None and s.finish_reason is None
        }

    @staticmethod
    def _advance(sequence: SequenceState, token: int) -> None:
        """The sequence's grammar past `token` (which its mask allowed)."""
        if sequence.grammar is not None and not sequence.grammar.accept(token):
            raise RuntimeError(f"the grammar refused token {token}, which its mask allowed")

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _ban(self, logits: torch.Tensor, sequences: list[SequenceState]) -> None:
        """Tokens a row may not pick now: its bad words' next tokens, and the end and stop
        tokens before `min_tokens`."""
        for row, sequence in enumerate(sequences):
            banned = banned_tokens(sequence.bad_ids, sequence.tokens)
            if len(sequence.tokens) < sequence.params.min_tokens:
                banned += [*self.eos_ids, *sequence.params.stop_token_ids]
            if banned:
                logits[row, banned] = -float("inf")

    def _append(self, sequence: SequenceState, token: int) -> None:
        request = sequence.params
        is_eos = token in self.eos_ids and not request.ignore_eos
        if is_eos or token in request.stop_token_ids:
            # As vLLM: the stop token ends token_ids, and the text stops before it.
            sequence.text = self._detokenize(sequence)
            sequence.tokens.append(token)
            sequence.finish_reason, sequence.stop_reason = "stop", (None if is_eos else token)
            return
        sequence.tokens.append(token)
        text = self._detokenize(sequence)
        found = find_stop(text, request.stop_strings, request.include_stop_str_in_output)
        if found is not None:
            sequence.text, sequence.stop_reason = found
            sequence.finish_reason = "stop"
            return
        sequence.text = text
        if len(sequence.tokens) >= sequence.limit:
            sequence.finish_reason = "length"

    def _detokenize(self, sequence: SequenceState) -> str:
        text, sequence.window = self.detokenizer.text(
            sequence.tokens, sequence.window, sequence.params.skip_special_tokens
        )
        return text
