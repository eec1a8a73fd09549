"""Greedy decode through transformers' `generate`, the same for every method, with the
time of each forward: the prefill (prompt in, first token out) and each decode step."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from offload.bench.machine import synchronize


@dataclass(frozen=True)
class Decoded:
    tokens: torch.Tensor  # [batch, output_len] the generated ids, on the CPU
    prefill_s: float
    step_s: list[float]  # each decode step after the first token

    @property
    def num_forwards(self) -> int:
        return 1 + len(self.step_s)


def greedy_decode(
    model: torch.nn.Module, ids: torch.Tensor, num_tokens: int, device: torch.device
) -> Decoded:
    """`num_tokens` greedy tokens after the prompt `ids` ([batch, prompt_len]); never stops
    early (an end-of-sequence token is not chosen before `num_tokens`)."""
    clock = _StepClock(device)
    config = GenerationConfig(
        max_new_tokens=num_tokens,
        min_new_tokens=num_tokens,
        do_sample=False,
        pad_token_id=_pad_token_id(model.config),
    )
    ids = ids.to(device)
    synchronize(device)
    started = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=config,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
    times = [started, *clock.times]
    steps = [after - before for before, after in itertools.pairwise(times)]
    return Decoded(output[:, ids.shape[1] :].cpu(), steps[0], steps[1:])


class _StepClock(StoppingCriteria):
    """Called by `generate` after each new token: the device is synchronised (the step's
    kernels have run) and the time noted. It never stops generation."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        synchronize(self.device)
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _pad_token_id(config) -> int:
    """Padding is never used (no prompt is padded) but `generate` wants an id."""
    for candidate in (getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(candidate, list | tuple):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0
