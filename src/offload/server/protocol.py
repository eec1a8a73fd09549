"""The OpenAI API's request and response bodies, as vLLM's server reads and writes them:
a request's JSON into `SamplingParams`, outputs into completion and chat objects (whole
or as stream chunks), and errors into OpenAI's error object."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from offload.engine.logprobs import Logprob
from offload.engine.sampling_params import SamplingParams
from offload.errors import ConfigError, shown
from offload.server.structured import FieldError, structured_outputs_of

# Request fields that go to SamplingParams under the same name (vLLM's extras included).
_SAME_NAME = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "ignore_eos", "min_tokens", "skip_special_tokens", "include_stop_str_in_output",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "allowed_token_ids",
    "bad_words", "truncate_prompt_tokens",
)  # fmt: skip
MAX_LOGIT_BIAS = 100  # OpenAI's range for a logit bias: [-100, 100]
_REFUSED = {
    "suffix": "suffix is not supported",
    "best_of": "best_of is not supported (vLLM's V1 engine refuses it too); use n",
}


class APIError(Exception):
    """An error answered as OpenAI's error object with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = ""):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or _KINDS.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status,
            }
        }


_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


def bad_request(error: ConfigError | ValueError) -> APIError:
    """A 400 naming the parameter the message starts with, where it names one."""
    message = str(error)
    first = message.split(" ", 1)[0].strip("`'\":,")
    known = (*_SAME_NAME, "max_tokens", "logprobs", "top_logprobs", "logit_bias", "messages")
    return APIError(400, message, first if first in known else None)


def _field(body: Mapping[str, Any], name: str, kinds: tuple[type, ...], default: Any = None):
    value = body.get(name, default)
    if value is None or value is default:
        return value
    if isinstance(value, bool) and bool not in kinds:
        value = None  # JSON true/false is no number here
    if value is None or not isinstance(value, kinds):
        allowed = " or ".join(k.__name__ for k in kinds)
        raise APIError(400, f"{name} must be {allowed}, got {body.get(name)!r}", name)
    return value


@dataclass(frozen=True)
class Request:
    """What every endpoint reads the same way."""

    model: str | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool = False  # (completions) the prompt before the completion, logprobs too


def sampling_params(body: Mapping[str, Any], *, chat: bool) -> Request:
    """The request's sampling settings, each checked with the parameter's name."""
    if not isinstance(body, Mapping):
        raise APIError(400, "the request body must be a JSON object")
    for name, why in _REFUSED.items():
        if body.get(name) not in (None, False):
            raise APIError(400, why, name)
    model = _field(body, "model", (str,))
    stream = bool(_field(body, "stream", (bool,), False))
    include_usage = _include_usage(body, stream)
    kwargs = {name: body[name] for name in _SAME_NAME if body.get(name) is not None}
    kwargs["max_tokens"] = _max_tokens(body, chat)
    kwargs["logprobs"] = _logprobs(body, chat)
    echo = not chat and bool(_field(body, "echo", (bool,), False))  # (chat: refused below)
    if chat and body.get("echo") not in (None, False):
        raise APIError(400, "echo is a completions parameter", "echo")
    prompt_logprobs = _field(body, "prompt_logprobs", (int,))
    if echo and kwargs["logprobs"] is not None:  # (vLLM: the prompt's tokens get logprobs too)
        prompt_logprobs = max(prompt_logprobs or 0, kwargs["logprobs"])
    if prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = prompt_logprobs
    bias = _logit_bias(body)
    if bias:
        kwargs["logit_bias"] = bias
    try:
        kwargs["structured_outputs"] = structured_outputs_of(body)
    except FieldError as error:
        raise APIError(400, str(error), error.param) from None
    try:
        params = SamplingParams(**kwargs)
    except (ConfigError, ValueError, TypeError) as error:
        raise bad_request(error) from None
    return Request(model, params, stream, include_usage, echo)


def _include_usage(body: Mapping[str, Any], stream: bool) -> bool:
    """`stream_options.include_usage`: a JSON boolean, and only with `stream` (as vLLM)."""
    options = _field(body, "stream_options", (dict,))
    if options is None:
        return False
    if not stream:
        raise APIError(400, "stream_options needs stream=true", "stream_options")
    usage = options.get("include_usage")
    if usage is None:  # (JSON null: unset)
        return False
    if not isinstance(usage, bool):
        raise APIError(
            400, f"stream_options.include_usage must be true or false, got {shown(usage)}",
            "stream_options",
        )  # fmt: skip
    return usage


def _logit_bias(body: Mapping[str, Any]) -> dict[int, float] | None:
    """`logit_bias`: token ids (JSON keys: digits) to numbers in [-100, 100], as OpenAI's API
    takes them (a string, inf or 1e308 is refused, not read or clamped)."""
    bias = _field(body, "logit_bias", (dict,))
    if not bias:
        return None
    checked = {}
    for token, value in bias.items():
        if not (token.isascii() and token.isdigit()):
            raise APIError(
                400, f"logit_bias keys must be token ids (digits), got {shown(token)}",
                "logit_bias",
            )  # fmt: skip
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise APIError(
                400, f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS}, "
                f"{MAX_LOGIT_BIAS}], got {shown(value)} for token {token}", "logit_bias",
            )  # fmt: skip
        checked[int(token)] = float(value)
    return checked


def _max_tokens(body: Mapping[str, Any], chat: bool) -> int | None:
    if chat:  # the newer name wins; none: as many as the context allows (vLLM)
        value = _field(body, "max_completion_tokens", (int,))
        return value if value is not None else _field(body, "max_tokens", (int,))
    return _field(body, "max_tokens", (int,), 16)  # OpenAI's default for completions


def _logprobs(body: Mapping[str, Any], chat: bool) -> int | None:
    if not chat:
        return _field(body, "logprobs", (int,))
    if not _field(body, "logprobs", (bool,), False):
        if body.get("top_logprobs"):
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        return None
    return _field(body, "top_logprobs", (int,)) or 0


def prompts_of(body: Mapping[str, Any]) -> list[str | list[int]]:
    """The completions endpoint's `prompt`: a string, token ids, or a list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        return [prompt]
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, str) or _is_ids(p) for p in prompt)
    ):
        return list(prompt)
    raise APIError(
        400, "prompt must be a string, a list of token ids, or a non-empty list of either", "prompt"
    )


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def messages_of(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat endpoint's `messages`, each content a string (OpenAI's content parts: the
    text ones, joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of messages", "messages")
    checked = []
    for number, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise APIError(400, "each message must be an object with a role", "messages")
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(_part_text(f"messages[{number}].content", p) for p in content)
        elif content is not None and not isinstance(content, str):
            raise APIError(
                400, "a message's content must be a string or a list of parts", "messages"
            )
        checked.append({**message, "content": content})
    return checked


def _part_text(where: str, part: object) -> str:
    """A content part's text: OpenAI's {"type": "text", "text": "..."} (text only)."""
    if not isinstance(part, dict) or part.get("type", "text") != "text":
        raise APIError(
            400, f"{where} parts must be {{\"type\": \"text\", \"text\": ...}} objects (this "
            f"server takes text only), got {shown(part)}", "messages",
        )  # fmt: skip
    text = part.get("text")
    if not isinstance(text, str):
        raise APIError(400, f"{where}[].text must be a string, got {shown(text)}", "messages")
    return text


# -- responses ----------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(
    entries: list[dict[int, Logprob] | None],
    tokens: list[int],
    offset: int,
    decoded: Callable[[int], str] = str,
) -> dict[str, list]:
    """The completions API's logprobs of `tokens` (text offsets from `offset`); an entry
    None (an echoed prompt's first token) has no logprob, its text `decoded(token)`."""
    texts, chosen, tops, offsets = [], [], [], []
    for entry, token in zip(entries, tokens, strict=False):
        if entry is None:  # (a prompt's first token: nothing before it)
            text = decoded(token)
            chosen.append(None)
            tops.append(None)
        else:
            text = entry[token].decoded_token or ""
            chosen.append(entry[token].logprob)
            tops.append({(lp.decoded_token or ""): lp.logprob for lp in entry.values()})
        texts.append(text)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": texts, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_of(entries: list[dict[int, Logprob] | None]) -> list | None:
    """vLLM's `prompt_logprobs` field: per prompt token (the first has none), token ids to
    their logprob, rank and text."""
    return [
        None
        if entry is None
        else {
            str(token): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token, lp in entry.items()
        }
        for entry in entries
    ]


def chat_logprobs(entries: list[dict[int, Logprob]], tokens: list[int], top: int) -> dict:
    """The chat API's logprobs: each token with its `top` most likely alternatives."""
    content = []
    for entry, token in zip(entries, tokens, strict=False):
        ranked = sorted(entry.values(), key=lambda lp: lp.rank or 0)[:top]
        content.append({**_token(entry[token]), "top_logprobs": [_token(lp) for lp in ranked]})
    return {"content": content}


def _token(logprob: Logprob) -> dict[str, Any]:
    text = logprob.decoded_token or ""
    return {"token": text, "logprob": logprob.logprob, "bytes": list(text.encode("utf-8"))}
