"""Speculative decoding (vLLM's `speculative_config`): a proposer guesses the next few
tokens of each running sequence, one forward of the model scores all of them
(`StepRunner.verify`), and every guess the model would have picked itself is a token
gained for the weights read once.

How a guess is accepted keeps the output exactly what the model gives without
speculation, greedy or sampled: the verify forward's logits at each guessed position go
through the same pick as a decode step's (grammar, penalties, bans, logprobs, the row's
own generator, stop conditions), one position after another; the guess is kept where the
token picked equals it, and the first token that differs (or the one past the last
guess) is the model's own next token. For a sampled row this is rejection sampling
against a guess taken as certain (vLLM's n-gram proposer's case): a guess survives with
the model's probability of it, and every token kept is drawn from the model's own
distribution by the row's own generator, in the order decoding without speculation
draws them. (vLLM's min(1, p/q) test accepts a drafter's sampled guesses more often,
but its tokens are not the ones decoding alone draws.)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from offload.config.validate import is_integer
from offload.engine.spec_tree import Tree, lookup_tree
from offload.errors import ConfigError, shown

METHODS = ("ngram", "draft_model")
# vLLM's other methods: refused by name (each needs heads or layers trained for it).
NOT_BUILT = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp", "suffix")
_KEYS = (
    "method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
    "quantization", "tree_budget",
)  # fmt: skip
MOST_TREE = 256  # the most nodes a row's tree may hold
_DEFAULT_LOOKUP = 5  # vLLM's n-gram window where neither bound is given
# The depths tried where `num_speculative_tokens` is left out (`Pace` keeps the fastest).
AUTO_DEPTHS = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class SpeculativeConfig:
    """What `speculative_config` asks (vLLM's keys): `method` "ngram" (prompt lookup:
    the longest of the last `prompt_lookup_max` down to `prompt_lookup_min` tokens found
    earlier in the sequence, and what followed it there) or "draft_model" (`model`: any
    model `LLM` loads, with the same tokenizer, resident: `engine/draft.py`);
    `num_speculative_tokens` guesses at most per sequence and step (None: as many as
    pay here, measured as it runs: `Pace`)."""

    method: str
    num_speculative_tokens: int | None
    model: str | None = None
    prompt_lookup_min: int = _DEFAULT_LOOKUP
    prompt_lookup_max: int = _DEFAULT_LOOKUP
    quantization: str | None = None  # the draft model's, as `LLM(quantization=...)`
    # A tree of guesses of at most this many nodes a row (`spec_tree`; ours, not vLLM's)
    tree_budget: int | None = None

    @staticmethod
    def of(value: object) -> SpeculativeConfig | None:
        """`value` as `LLM(speculative_config=...)` or `--speculative-config` gives it (a
        mapping, a JSON object, or None/empty: no speculation); one line naming what is
        wrong otherwise."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else None
            except json.JSONDecodeError as error:
                raise ConfigError(f"speculative_config: not JSON ({error.msg})") from None
        if value is None or (isinstance(value, Mapping) and not value):
            return None
        if not isinstance(value, Mapping):
            raise ConfigError(f"speculative_config must be a mapping, got {shown(value)}")
        return _parse(dict(value))


def _parse(value: dict[str, Any]) -> SpeculativeConfig:
    unknown = [key for key in value if key not in _KEYS]
    if unknown:
        raise ConfigError(
            f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(_KEYS)})"
        )
    method, model = value.get("method"), value.get("model")
    if method in ("[ngram]",) or (method is None and model in ("ngram", "[ngram]")):
        method, model = "ngram", None
    elif method is None and model is not None:
        method = "draft_model"
    if isinstance(method, str) and method.lower() in NOT_BUILT:
        raise ConfigError(
            f"speculative_config: method {method!r} is not available here "
            f"(available: {', '.join(METHODS)})"
        )
    if method not in METHODS:
        raise ConfigError(
            f"speculative_config: method must be one of {', '.join(METHODS)}, got {shown(method)}"
        )
    number = value.get("num_speculative_tokens")
    if number is not None and (not is_integer(number, 1) or number > 64):
        raise ConfigError(
            "speculative_config: num_speculative_tokens must be an integer from 1 to 64, "
            f"got {shown(number)} (or left out: as many as pay, measured as it runs)"
        )
    tree = value.get("tree_budget")
    if tree is not None and (not is_integer(tree, 1) or tree > MOST_TREE):
        raise ConfigError(
            f"speculative_config: tree_budget must be an integer from 1 to {MOST_TREE}, "
            f"got {shown(tree)}"
        )
    if tree is not None and number is not None and tree < number:
        raise ConfigError(
            f"speculative_config: tree_budget ({tree}) must hold the "
            f"num_speculative_tokens ({number}) of the tree's first branch"
        )
    config = _method_config(value, method, model, number)
    return dataclasses.replace(config, tree_budget=tree)


def _method_config(value: dict[str, Any], method: str, model, number) -> SpeculativeConfig:
    if method == "draft_model":
        if not isinstance(model, str) or not model:
            raise ConfigError("speculative_config: method 'draft_model' needs a 'model'")
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if key in value:
                raise ConfigError(f"speculative_config: {key} is for method 'ngram'")
        quantization = value.get("quantization")
        if quantization is not None and not isinstance(quantization, str):
            raise ConfigError(
                f"speculative_config: quantization must be a name, got {shown(quantization)}"
            )
        return SpeculativeConfig(method, number, model, quantization=quantization)
    if model is not None or "quantization" in value:
        raise ConfigError("speculative_config: method 'ngram' takes no 'model' or 'quantization'")
    low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    low = high if low is None else low
    high = low if high is None else high
    low = _DEFAULT_LOOKUP if low is None else low
    high = _DEFAULT_LOOKUP if high is None else high
    for name, bound in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
        if not is_integer(bound, 1):
            raise ConfigError(
                f"speculative_config: {name} must be an integer >= 1, got {shown(bound)}"
            )
    if low > high:
        raise ConfigError(
            f"speculative_config: prompt_lookup_min ({low}) is more than prompt_lookup_max ({high})"
        )
    return SpeculativeConfig(method, number, None, low, high)


def lookup(tokens: list[int], low: int, high: int, count: int) -> list[int]:
    """Prompt lookup: the longest suffix of `tokens` of `high` down to `low` tokens that
    occurs earlier in `tokens`, and up to `count` tokens that followed its latest
    occurrence there; [] where none occurs."""
    length = len(tokens)
    for size in range(min(high, length - 1), low - 1, -1):
        suffix = tokens[length - size :]
        # the latest earlier occurrence: starts before the suffix's own start
        first = suffix[0]
        for begin in range(length - size - 1, -1, -1):
            if tokens[begin] == first and tokens[begin : begin + size] == suffix:
                return tokens[begin + size : begin + size + count]
    return []


def guesses_for(
    speculator, rows, max_len: int, most: int, trees: bool = False
) -> list[Tree] | None:
    """`speculator`'s guesses for the engine's decoding `rows`, each row's `Tree` (a
    chain, or with `tree_budget` and where `trees` are taken, a tree of that many nodes at
    most) at most `most` deep, within its row's columns (below `max_len`) and its
    sequence's tokens to go; None where there are none, no speculator, or a row replays a
    preempted request's known tokens (a plain step)."""
    if speculator is None or most <= 0 or any(row.replaying for row in rows):
        return None
    config = speculator.config
    most = min(most, config.num_speculative_tokens or most)
    counts = [
        min(most, max_len - 1 - row.column, row.sequence.to_go - 1) if row.is_live else 0
        for row in rows
    ]
    if max(counts) <= 0:
        return None
    if trees and config.tree_budget:
        room = [min(config.tree_budget, max_len - 1 - row.column) for row in rows]
        guesses = speculator.propose_tree(rows, counts, room)
    else:
        guesses = [Tree.chain(chain) for chain in speculator.propose(rows, counts)]
    return guesses if any(len(tree) for tree in guesses) else None


class NgramProposer:
    """Guesses by prompt lookup (`lookup`) over each row's prompt and tokens so far."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def propose(self, rows, counts: list[int]) -> list[list[int]]:
        """Up to `counts[i]` guesses for `rows[i]` (engine `Row`s, each past its last
        token's pick)."""
        low, high = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        guesses = []
        for row, count in zip(rows, counts, strict=True):
            tokens = row.sequence.prompt_ids + row.sequence.tokens
            guesses.append(lookup(tokens, low, high, count) if count > 0 else [])
        return guesses

    def propose_tree(self, rows, counts: list[int], budgets: list[int]) -> list[Tree]:
        """`spec_tree.lookup_tree` of each row: `counts[i]` deep, `budgets[i]` nodes."""
        low, high = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        return [
            lookup_tree(row.sequence.prompt_ids + row.sequence.tokens, low, high, count, budget)
            if count > 0 and budget > 0
            else Tree([], [])
            for row, count, budget in zip(rows, counts, budgets, strict=True)
        ]


def depths_of(config: SpeculativeConfig | None) -> tuple[int, ...]:
    """The depths a `Pace` tries for `config`: the user's number, or `AUTO_DEPTHS`."""
    if config is None or config.num_speculative_tokens is None:
        return AUTO_DEPTHS
    return (config.num_speculative_tokens,)


class Pace:
    """How many guesses pay here, measured as it runs: the tokens per second of turns at
    each depth (`depths`: the most guesses a turn scores; 0, plain steps, is always one of
    them) as decayed averages, each depth measured first and the others tried again now
    and then. Where guesses are scored at little more than the cost of one position
    (weights streamed from disk or over the link: bytes dominate) deeper guessing wins;
    where a verify forward computes for every position (a CPU's resident weights) and few
    guesses are kept, plain steps win, and speculation is left off until a later trial
    says otherwise. With the user's `num_speculative_tokens`, the depths are it and 0;
    without, a few (`AUTO_DEPTHS`), and the best is kept."""

    TRIAL = 4  # turns each depth runs when tried
    EVERY = 64  # turns between trials of a depth not chosen, at first
    MOST = 4096  # ... doubled while each trial confirms the choice, up to this many
    DECAY = 0.8  # weight of the past in each depth's average

    def __init__(self, depths: tuple[int, ...] = (1,)):
        self.depths = (*sorted({d for d in depths if d > 0}), 0)  # (plain steps last)
        self._rate = dict.fromkeys(self.depths, 0.0)  # depth -> tokens/s (decayed)
        self._count = dict.fromkeys(self.depths, 0)  # depth -> turns measured
        self._turn = self.TRIAL  # turns since the last trial began
        self._every = self.EVERY
        self._best = self.depths[0]
        self._trying = self.depths[0]
        self._trials = 0

    def guesses(self) -> int:
        """The most guesses the next turn scores (0: a plain step)."""
        for depth in self.depths:  # each measured first, in order
            if self._count[depth] < self.TRIAL:
                return depth
        best = max(self.depths, key=lambda d: (self._rate[d], -self.depths.index(d)))
        if best != self._best:  # (a trial changed the choice: it ends; the next comes soon)
            self._best, self._every, self._turn = best, self.EVERY, self.TRIAL
        self._turn += 1
        if self._turn > self._every:  # a trial of another depth begins
            self._turn = 0
            self._every = min(2 * self._every, self.MOST)
            others = [d for d in self.depths if d != best]
            self._trying = others[self._trials % len(others)]
            self._trials += 1
        return self._trying if self._turn < self.TRIAL else best

    def record(self, depth: int, tokens: int, seconds: float) -> None:
        """A turn that scored up to `depth` guesses (0: none): `tokens` new tokens in
        `seconds` (its guessing, forward and picks)."""
        if seconds <= 0 or tokens <= 0 or depth not in self._rate:
            return
        rate, count = tokens / seconds, self._count[depth]
        self._rate[depth] = (
            rate if count == 0 else (self.DECAY * self._rate[depth] + (1 - self.DECAY) * rate)
        )
        self._count[depth] = count + 1
