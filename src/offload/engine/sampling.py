"""`SamplingParams` with vLLM's names, defaults and checks, and the sampler itself."""

from __future__ import annotations

import math
from collections.abc import Sequence
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
        if self.is_greedy:  # as vLLM: the filters mean nothing for greedy decoding
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A request's own random stream when it has a seed (None: the global one)."""
    if params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed % 2**64)
    return generator


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One request's logits [vocab] after temperature, top-k, top-p and min-p: the
    filtered-out tokens are -inf."""
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1.0 or params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        keep = torch.ones_like(probs, dtype=torch.bool)
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always the top token).
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            keep_sorted = before < params.top_p
            keep = torch.zeros_like(keep).scatter(0, order, keep_sorted)
        if params.min_p > 0.0:
            keep &= probs >= params.min_p * probs.max()
        logits = logits.masked_fill(~keep, -math.inf)
    return logits


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """The next token of each request: logits [batch, vocab] -> token ids [batch].

    Greedy rows take the argmax of the raw logits (bitwise what a model without
    offloading picks); the others draw from their filtered distribution with their own
    generator, so a seeded request gives the same tokens alone or in any batch.
    """
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)  # [batch]
    for row, (request, generator) in enumerate(zip(params, generators, strict=True)):
        if request.is_greedy:
            tokens[row] = torch.argmax(logits[row])
            continue
        probs = torch.softmax(filter_logits(logits[row], request), dim=-1)
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
