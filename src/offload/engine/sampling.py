"""`SamplingParams` with vLLM's names, defaults and checks, and the sampler itself."""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from offload.errors import ConfigError

GREEDY_EPS = 1e-5  # vLLM's: a temperature below this is greedy decoding


def _number(name: str, value: object, low: float, high: float, *, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if value < low or (low_open and value == low) or value > high:
        bracket = "(" if low_open else "["
        raise ConfigError(f"{name} must be in {bracket}{low}, {high}], got {value!r}")
    return float(value)


def _integer(name: str, value: object, low: int, high: float = math.inf) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        allowed = f">= {low}" if high == math.inf else f"in [{low}, {high}]"
        raise ConfigError(f"{name} must be an integer {allowed}, got {value!r}")
    return value


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop (vLLM's `SamplingParams`, same meanings).

    `temperature=0` is greedy decoding; `top_k` of 0 or -1 and `top_p=1` switch those
    filters off; `seed` makes a request's sampling reproducible on its own, whatever
    else is in the batch; `stop` strings end the text (not included in it unless
    `include_stop_str_in_output`); generation also ends at `max_tokens`, at the model's
    end-of-sequence token (unless `ignore_eos`) and at any of `stop_token_ids`.

    Before any token is picked (greedy too), as vLLM does: only `allowed_token_ids` may
    be picked; `logit_bias` ({token id: bias}, clamped to [-100, 100]) is added; a token
    seen in the prompt or the output has its logit divided by `repetition_penalty` (> 0;
    multiplied when negative); `frequency_penalty` times the number of times a token was
    generated and `presence_penalty` once if it was (both in [-2, 2]) are subtracted.
    `bad_words` are never generated (a word of several tokens loses its last token
    when the output ends with the others). `truncate_prompt_tokens=k` keeps the last k
    prompt tokens (-1: as many as `max_model_len` allows).
    `logprobs=k` returns, for each generated token, its log-probability and those of
    the k most likely tokens (-1: all), from the model's raw logits; `prompt_logprobs`
    the same for each prompt token after the first.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.n = _integer("n", self.n, 1)
        self.temperature = _number("temperature", self.temperature, 0.0, math.inf)
        self.top_p = _number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        self.top_k = _integer("top_k", self.top_k, -1)
        self.min_p = _number("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            self.seed = _integer("seed", self.seed, -(2**63), 2**64 - 1)
        self.max_tokens = _integer("max_tokens", self.max_tokens, 1)
        self.min_tokens = _integer("min_tokens", self.min_tokens, 0, self.max_tokens)
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if not isinstance(stops, list | tuple) or not all(isinstance(s, str) and s for s in stops):
            raise ConfigError(
                f"stop must be a non-empty string or a list of them, got {self.stop!r}"
            )
        self.stop_strings = tuple(stops)
        ids = list(self.stop_token_ids or [])
        self.stop_token_ids = [_integer("stop_token_ids[]", i, 0) for i in ids]
        self._check_logit_rules()
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, _integer(name, getattr(self, name), -1))
        if self.truncate_prompt_tokens is not None:
            keep = self.truncate_prompt_tokens
            if isinstance(keep, bool) or not isinstance(keep, int) or keep == 0 or keep < -1:
                raise ConfigError(
                    f"truncate_prompt_tokens must be an integer >= 1 or -1, got {keep!r}"
                )
        words = self.bad_words
        if words is not None and (
            isinstance(words, str)
            or not isinstance(words, list | tuple)
            or not all(isinstance(w, str) and w.strip() for w in words)
        ):
            raise ConfigError(f"bad_words must be a list of non-blank strings, got {words!r}")
        if self.is_greedy:  # as vLLM: the filters mean nothing for greedy decoding
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _check_logit_rules(self) -> None:
        self.presence_penalty = _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.repetition_penalty = _number(
            "repetition_penalty", self.repetition_penalty, 0.0, math.inf, low_open=True
        )
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise ConfigError(
                    f"logit_bias must be a dict of token id to bias, got {self.logit_bias!r}"
                )
            # Keys may be strings, as JSON has them; biases clamped as OpenAI's API does.
            self.logit_bias = {
                _token_id("logit_bias", token): min(
                    100.0, max(-100.0, _number("logit_bias[]", bias, -math.inf, math.inf))
                )
                for token, bias in self.logit_bias.items()
            }
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if isinstance(ids, str | bytes) or not isinstance(ids, Sequence) or not ids:
                raise ConfigError(
                    f"allowed_token_ids must be a non-empty list of token ids, got {ids!r}"
                )
            self.allowed_token_ids = [_integer("allowed_token_ids[]", i, 0) for i in ids]

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def token_ids_named(self) -> dict[str, list[int]]:
        """The token ids this request names, by field (to check against the vocabulary)."""
        return {
            "stop_token_ids": self.stop_token_ids,
            "logit_bias": list(self.logit_bias or {}),
            "allowed_token_ids": self.allowed_token_ids or [],
        }


def bad_words_token_ids(words: Sequence[str], encode) -> list[list[int]]:
    """The token sequences of each bad word as vLLM finds them: the word alone, and with
    a leading space when that is a different first token of the same length (so the word
    is banned at the start of the text and after a space)."""
    found: list[list[int]] = []
    for word in words:
        alone = encode(word.lstrip())
        spaced = encode(" " + word.lstrip())
        found.append(alone)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            found.append(spaced)
    return [ids for ids in found if ids]


def banned_tokens(bad_ids: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The tokens that would complete a bad word after `output` (a one-token word always)."""
    banned = []
    for ids in bad_ids:
        head = list(ids[:-1])
        if not head or list(output[len(output) - len(head) :]) == head:
            banned.append(ids[-1])
    return banned


def _token_id(name: str, token: object) -> int:
    try:
        value = int(token) if isinstance(token, str) else operator.index(token)
    except (TypeError, ValueError):
        value = -1
    if isinstance(token, bool) or value < 0:
        raise ConfigError(f"{name} keys must be token ids (integers >= 0), got {token!r}")
    return value


class TokenCounts:
    """What the penalties read for one sequence, on the device: which tokens its prompt
    holds and how many times it generated each token."""

    def __init__(self, prompt_ids: Sequence[int], vocab_size: int, device: torch.device):
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # [vocab]
        self.in_prompt[torch.tensor(list(prompt_ids), device=device)] = True
        self.generated = torch.zeros(vocab_size, dtype=torch.float32, device=device)  # [vocab]

    def add(self, token: int) -> None:
        self.generated[token] += 1


def adjust_logits(
    logits: torch.Tensor, params: SamplingParams, counts: TokenCounts | None
) -> torch.Tensor:
    """One request's logits [vocab] after vLLM's argmax-changing steps, in its order:
    allowed tokens, logit bias, then the repetition, frequency and presence penalties
    (in float32). Unchanged, and not copied, when the request asks for none of them."""
    if not (params.allowed_token_ids or params.logit_bias or params.has_penalties):
        return logits
    logits = logits.float()
    if params.allowed_token_ids:
        allowed = torch.zeros_like(logits, dtype=torch.bool)
        allowed[params.allowed_token_ids] = True
        logits = logits.masked_fill(~allowed, -math.inf)
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=logits.device)
        bias = torch.tensor(list(params.logit_bias.values()), device=logits.device)
        logits = logits.index_add(0, ids, bias)
    if params.has_penalties:
        generated = counts.generated
        if params.repetition_penalty != 1.0:
            seen = counts.in_prompt | (generated > 0)
            penalty = params.repetition_penalty
            scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, scaled, logits)
        logits = logits - params.frequency_penalty * generated
        logits = logits - params.presence_penalty * (generated > 0).float()
    return logits


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A request's own random stream when it has a seed (None: the global one)."""
    if params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed % 2**64)
    return generator


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One request's logits [vocab] after temperature, then min-p, top-k and top-p in
    vLLM's order (top-p over what min-p and top-k left): filtered-out tokens are -inf."""
    logits = logits.float() / params.temperature
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), -math.inf)
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1.0:
        probs = torch.softmax(logits, dim=-1)
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always the top token).
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter(0, order, before < params.top_p)
        logits = logits.masked_fill(~keep, -math.inf)
    return logits


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    counts: Sequence[TokenCounts | None] | None = None,
) -> torch.Tensor:
    """The next token of each request: logits [batch, vocab] -> token ids [batch].

    Greedy rows take the argmax of the raw logits (bitwise what a model without
    offloading picks) after `adjust_logits`; the others draw from their filtered
    distribution with their own generator, so a seeded request gives the same tokens
    alone or in any batch. `counts` (one per row) feed the penalties.
    """
    counts = counts if counts is not None else [None] * len(params)
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)  # [batch]
    for row, (request, generator) in enumerate(zip(params, generators, strict=True)):
        row_logits = adjust_logits(logits[row], request, counts[row])
        if request.is_greedy:
            tokens[row] = torch.argmax(row_logits)
            continue
        probs = torch.softmax(filter_logits(row_logits, request), dim=-1)
        tokens[row] = torch.multinomial(probs, 1, generator=generator)[0]
    return tokens


def find_stop(text: str, stops: Sequence[str], include: bool = False) -> tuple[str, str] | None:
    """If `text` contains a stop string: the text up to the earliest one (with it when
    `include`), and that stop string; else None."""
    hits = [(text.find(stop), stop) for stop in stops if stop in text]
    if not hits:
        return None
    start, stop = min(hits)
    return (text[: start + len(stop)] if include else text[:start]), stop
