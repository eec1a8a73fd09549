"""The sampler: vLLM's logit adjustments, filters and draws for a batch of requests
(each with its own `SamplingParams`), bad words and stop strings."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from offload.engine.sampling_params import SamplingParams
from offload.errors import ConfigError, ModelError, NonFiniteLogits


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
    if not asks_adjustment(params):
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


def asks_adjustment(params: SamplingParams) -> bool:
    """Whether `adjust_logits` changes anything for `params`."""
    return bool(params.allowed_token_ids or params.logit_bias or params.has_penalties)


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
    prompts: Sequence[int] | None = None,
) -> torch.Tensor:
    """The next token of each request: logits [batch, vocab] -> token ids [batch].

    Greedy rows take the argmax of the raw logits (bitwise what a model without
    offloading picks) after `adjust_logits`; the others draw from their filtered
    distribution with their own generator, so a seeded request gives the same tokens
    alone or in any batch. `counts` (one per row) feed the penalties.

    A row with nothing to pick from (every token excluded, or inf/nan where the
    settings or the model overflowed) raises one line naming the cause and the prompt
    (`prompts`: each row's index in the call), never a wrong token or torch's error.
    """
    counts = counts if counts is not None else [None] * len(params)
    device = logits.device
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=device)  # [batch]
    # per row, on the device: checked once for the batch (one sync)
    unusable = torch.zeros(logits.shape[0], dtype=torch.bool, device=device)  # [batch]
    # Plain greedy rows (the server's usual batch) in one pass: the same argmax, row by row.
    plain = [row for row, p in enumerate(params) if p.is_greedy and not asks_adjustment(p)]
    if len(plain) == logits.shape[0]:  # (every row: no copy of the logits)
        tokens, unusable = _greedy(logits)
    elif plain:
        index = torch.tensor(plain, device=device)
        tokens[index], unusable[index] = _greedy(logits.index_select(0, index))
    for row, (request, generator) in enumerate(zip(params, generators, strict=True)):
        if request.is_greedy and not asks_adjustment(request):
            continue
        row_logits = adjust_logits(logits[row], request, counts[row])
        if request.is_greedy:
            unusable[row] = _unusable(row_logits)
            tokens[row] = torch.argmax(row_logits)
            continue
        probs = torch.softmax(filter_logits(row_logits, request), dim=-1)
        bad = _unusable(probs)
        unusable[row] = bad
        # A bad row draws from a stand-in, so multinomial (a device assert on a GPU) never
        # sees it; the error below is raised instead.
        probs = torch.where(bad, torch.ones_like(probs), probs)
        tokens[row] = torch.multinomial(probs, 1, generator=generator)[0]
    if bool(unusable.any()):
        row = int(unusable.nonzero()[0])
        prompt = row if prompts is None else prompts[row]
        raise _why_unusable(logits[row], params[row], counts[row], prompt)
    return tokens


def _greedy(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The argmax of logits [rows, vocab], and `_unusable` of each row in the same pass:
    argmax picks a nan where there is one and +inf before any finite value, so the
    picked logit is finite exactly where the row has something to pick (16 rows of the
    default model: one pass over 3 MB instead of five)."""
    picked = torch.argmax(rows, dim=-1)
    return picked, ~torch.isfinite(rows.gather(1, picked[:, None])[:, 0])


def _unusable(values: torch.Tensor) -> torch.Tensor:
    """True when nothing can be picked from logits or probabilities [..., vocab]: one
    flag per row (a 0-d tensor for one row)."""
    nan, inf = torch.isnan(values).any(-1), torch.isposinf(values).any(-1)
    return nan | inf | torch.isneginf(values).all(-1)


def _why_unusable(
    raw: torch.Tensor, request: SamplingParams, counts: TokenCounts | None, prompt: int
) -> ConfigError | ModelError:
    """The error for a row `sample` could not pick from: which setting (or the model)
    left no finite choice. Runs only on that path, so it may recompute."""
    if bool(torch.isnan(raw).any() | torch.isposinf(raw).any()):
        return NonFiniteLogits(
            f"the model's logits for prompt {prompt} hold nan or inf: its activations "
            "overflowed its dtype (try dtype='float32'), or its float weights hold nan or inf "
            "(a damaged checkpoint; quantized scales and .gguf blocks are checked at load)"
        )
    adjusted = adjust_logits(raw, request, counts)
    if bool(torch.isneginf(adjusted).all()):
        rules = [
            name
            for name, value in (
                ("structured_outputs", request.structured_outputs),
                ("allowed_token_ids", request.allowed_token_ids),
                ("bad_words", request.bad_words),
                ("min_tokens (bans the end and stop tokens)", request.min_tokens),
            )
            if value
        ]
        return ConfigError(
            f"no token is left to pick for prompt {prompt}: "
            f"{', '.join(rules) or 'the bans'} exclude every token"
        )
    if bool(_unusable(adjusted)):  # only the penalties can overflow (the bias is clamped)
        penalties = ", ".join(
            f"{name}={value:g}"
            for name, value, off in (
                ("repetition_penalty", request.repetition_penalty, 1.0),
                ("frequency_penalty", request.frequency_penalty, 0.0),
                ("presence_penalty", request.presence_penalty, 0.0),
            )
            if value != off
        )
        return ConfigError(
            f"{penalties} made the logits of prompt {prompt} inf or nan; "
            "use a repetition_penalty nearer 1"
        )
    return ConfigError(
        f"temperature={request.temperature:g} (with top_p={request.top_p:g}, "
        f"top_k={request.top_k}, min_p={request.min_p:g}) made the probabilities of prompt "
        f"{prompt} inf or nan"
    )


def find_stop(text: str, stops: Sequence[str], include: bool = False) -> tuple[str, str] | None:
    """If `text` contains a stop string: the text up to the earliest one (with it when
    `include`), and that stop string; else None."""
    hits = [(text.find(stop), stop) for stop in stops if stop in text]
    if not hits:
        return None
    start, stop = min(hits)
    return (text[: start + len(stop)] if include else text[:start]), stop
