"""Log-probabilities of the chosen tokens and of the most likely ones, as vLLM reports
them: from the model's raw logits, before any penalty, bias or filter."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class Logprob:
    """One token's log-probability, its rank among all tokens (1: the most likely) and
    its text (vLLM's `Logprob`)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Raw logits [..., vocab] -> log-probabilities in float32."""
    return torch.log_softmax(logits.float(), dim=-1)


def token_logprobs(
    logprobs: torch.Tensor, token: int, num: int, decode: Callable[[int], str]
) -> dict[int, Logprob]:
    """The chosen `token` first, then the `num` most likely tokens (-1: all of them),
    from one position's log-probabilities [vocab]. As vLLM: the chosen token's rank is
    how many tokens are at least as likely; the others' are their place in the top."""
    chosen = logprobs[token]
    rank = int((logprobs >= chosen).sum())
    entries = {token: Logprob(float(chosen), rank, decode(token))}
    num = logprobs.numel() if num == -1 else min(num, logprobs.numel())
    if num > 0:
        top = torch.topk(logprobs, num)
        for place, (value, other) in enumerate(
            zip(top.values.tolist(), top.indices.tolist(), strict=True), start=1
        ):
            if other not in entries:
                entries[other] = Logprob(value, place, decode(other))
    return entries


def prompt_logprobs(
    logits: torch.Tensor, prompt_ids: Sequence[int], num: int, decode: Callable[[int], str]
) -> list[dict[int, Logprob] | None]:
    """For a prompt's logits [len, vocab]: None for the first token (nothing predicts
    it), then each next token's entry from the logits of the position before it."""
    logprobs = log_softmax(logits[:-1])  # [len - 1, vocab]
    return [None] + [
        token_logprobs(logprobs[i], token, num, decode) for i, token in enumerate(prompt_ids[1:])
    ]
