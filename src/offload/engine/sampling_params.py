"""`SamplingParams`: vLLM's names, defaults and checks of how to pick tokens and when
to stop. The sampler that reads them is `sampling.py`."""

from __future__ import annotations

import functools
import math
import operator
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields

from offload.config.limits import SEED_RANGE
from offload.config.validate import flag, integer, real, refusal
from offload.engine.structured import StructuredOutputsParams
from offload.errors import ConfigError, did_you_mean, shown

GREEDY_EPS = 1e-5  # vLLM's: a temperature below this is greedy decoding
# vLLM's bounds: a temperature in (0, MIN_TEMPERATURE) is raised to it (logits divided
# by less overflow float32), and above MAX_TEMPERATURE it is refused.
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 2.0
MAX_N = 16384  # vLLM's default VLLM_MAX_N_SEQUENCES


def _items(name: str, value: object, what: str) -> list:
    """A list of the items of `value`: a list, tuple or set (not a string or a dict)."""
    if isinstance(value, str | bytes | bytearray | Mapping) or not isinstance(value, Iterable):
        raise ConfigError(f"{name} must be a list of {what}, got {shown(value)}")
    return list(value)


def _names_checked(cls):
    """A mistyped argument name gets the nearest real one in its TypeError
    (`SamplingParams(max_token=5)`: did you mean 'max_tokens'?)."""
    init = cls.__init__

    @functools.wraps(init)
    def checked(self, *args, **kwargs):
        names = [f.name for f in fields(cls)]
        for name in kwargs:
            if name not in names:
                raise TypeError(
                    f"{cls.__name__}() got an unexpected argument {name!r}"
                    f"{did_you_mean(name, names)}; it takes {', '.join(names)}"
                )
        init(self, *args, **kwargs)

    cls.__init__ = checked
    return cls


@_names_checked
@dataclass
class SamplingParams:
    """How to pick tokens and when to stop (vLLM's `SamplingParams`, same meanings).

    `temperature=0` is greedy decoding; `top_k` of 0 or -1 and `top_p=1` switch those
    filters off; `seed` makes a request's sampling reproducible on its own, whatever
    else is in the batch; `stop` strings end the text (not included in it unless
    `include_stop_str_in_output`); generation also ends at `max_tokens` (None: when the
    prompt and output fill `max_model_len`, as in vLLM), at the model's
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
    `structured_outputs` (a `StructuredOutputsParams`: a JSON schema, regex, choice or
    grammar) allows only the tokens that keep the output in its language, and ends the
    output when the language does; then logprobs are those of the masked logits, as
    vLLM's. (`guided_decoding`: vLLM's older name for it.)
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
    max_tokens: int | None = 16  # None: until max_model_len, as in vLLM
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
    best_of: int | None = None  # vLLM's V0 name, refused as its V1 engine refuses it
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # (vLLM's older name)
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.n = integer("n", self.n, 1, MAX_N)
        if self.best_of is not None:
            raise ConfigError(
                f"best_of={shown(self.best_of)} is not supported (nor by vLLM's V1 engine); "
                "n=k returns k samples"
            )
        self._check_temperature()
        self.top_p = real("top_p", self.top_p, 0.0, 1.0, low_open=True)
        self.top_k = integer("top_k", self.top_k, -1)
        self.min_p = real("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            self.seed = integer("seed", self.seed, *SEED_RANGE)
        if self.max_tokens is not None:
            self.max_tokens = integer("max_tokens", self.max_tokens, 1)
        self.min_tokens = integer("min_tokens", self.min_tokens, 0, self.max_tokens)
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is None:
            stops = []
        if not isinstance(stops, list | tuple) or not all(isinstance(s, str) and s for s in stops):
            raise ConfigError(
                f"stop must be a non-empty string or a list of them, got {shown(self.stop)}"
            )
        self.stop_strings = tuple(stops)
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        ids = _items("stop_token_ids", ids, "token ids")
        self.stop_token_ids = [integer("stop_token_ids[]", i, 0) for i in ids]
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            setattr(self, name, flag(name, getattr(self, name)))
        self._check_logit_rules()
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, integer(name, getattr(self, name), -1))
        if self.truncate_prompt_tokens is not None:
            keep = self.truncate_prompt_tokens
            allowed = "an integer >= 1 or -1"
            if integer("truncate_prompt_tokens", keep, -1, what=allowed) == 0:
                raise refusal("truncate_prompt_tokens", keep, allowed)
        words = self.bad_words
        if words is not None and (
            isinstance(words, str)
            or not isinstance(words, list | tuple)
            or not all(isinstance(w, str) and w.strip() for w in words)
        ):
            raise ConfigError(f"bad_words must be a list of non-blank strings, got {shown(words)}")
        self._check_structured_outputs()
        if self.is_greedy:  # as vLLM: the filters mean nothing for greedy decoding
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _check_temperature(self) -> None:
        """vLLM's range; a tiny temperature is raised (with a warning, as vLLM does) so
        the logits divided by it stay finite in float32."""
        temperature = real("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        if 0.0 < temperature < MIN_TEMPERATURE:
            warnings.warn(
                f"temperature {temperature:g} is below {MIN_TEMPERATURE}, which may make the "
                f"probabilities inf or nan; it is raised to {MIN_TEMPERATURE}",
                UserWarning,
                stacklevel=4,
            )
            temperature = MIN_TEMPERATURE
        self.temperature = temperature

    def _check_logit_rules(self) -> None:
        self.presence_penalty = real("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = real("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.repetition_penalty = real(
            "repetition_penalty",
            self.repetition_penalty,
            0.0,
            math.inf,
            low_open=True,
            high_open=True,
        )
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise ConfigError(
                    f"logit_bias must be a dict of token id to bias, got {shown(self.logit_bias)}"
                )
            # Keys may be strings, as JSON has them; biases clamped as OpenAI's API does.
            self.logit_bias = {
                _token_id("logit_bias", token): min(
                    100.0, max(-100.0, real("logit_bias[]", bias, -math.inf, math.inf))
                )
                for token, bias in self.logit_bias.items()
            }
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if isinstance(ids, str | bytes) or not isinstance(ids, Sequence) or not ids:
                raise ConfigError(
                    f"allowed_token_ids must be a non-empty list of token ids, got {shown(ids)}"
                )
            self.allowed_token_ids = [integer("allowed_token_ids[]", i, 0) for i in ids]

    def _check_structured_outputs(self) -> None:
        """One `StructuredOutputsParams` (a dict of its fields is made into one), from
        either name."""
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ConfigError("give structured_outputs or guided_decoding, not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        value = self.structured_outputs
        if isinstance(value, Mapping):
            try:
                value = StructuredOutputsParams(**value)
            except TypeError:
                raise ConfigError(
                    f"structured_outputs takes {', '.join(StructuredOutputsParams.FIELDS)}, "
                    f"got {shown(sorted(map(str, value)))}"
                ) from None
        if value is not None and not isinstance(value, StructuredOutputsParams):
            raise ConfigError(
                f"structured_outputs must be a StructuredOutputsParams, got {shown(value)}"
            )
        self.structured_outputs = value

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


def _token_id(name: str, token: object) -> int:
    try:
        value = int(token) if isinstance(token, str) else operator.index(token)
    except (TypeError, ValueError):
        value = -1
    if isinstance(token, bool) or value < 0:
        raise ConfigError(f"{name} keys must be token ids (integers >= 0), got {shown(token)}")
    return value
