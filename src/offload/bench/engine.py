"""`LLM`, this library's engine, as a bench method: every weight resident, its own decode
loop (a compiled step on a CPU, CUDA graphs on a GPU) instead of transformers' `generate`,
which every other method runs. Beside llama.cpp it is the figure a user of `LLM` gets."""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch

from offload.bench.decode import Decoded
from offload.bench.machine import synchronize
from offload.bench.method import Figures, Method, MethodUnavailable


class Engine(Method):
    name = "llm"
    label = "offload's LLM engine, resident (compiled CPU step / CUDA graphs; not generate)"

    def __init__(self, prepared):
        super().__init__(prepared)
        self._llm: Any = None
        self._ready: set[int] = set()  # batch sizes whose step is compiled or loaded

    def speculative_config(self) -> dict[str, Any] | None:
        """What the engine guesses with (None: no speculation)."""
        return None

    def setting(self) -> dict[str, Any]:
        spec = self.speculative_config()
        return {"speculative_config": spec} if spec is not None else {}

    def load(self) -> None:
        from offload.llm import LLM

        dtype = self.prepared.workload.dtype
        # (no prefix caching: the rounds repeat their prompts, and each should time the
        # prefill every other method pays, not a cache hit)
        self._llm = LLM(
            str(self.prepared.path),
            dtype=dtype,
            device=str(self.device),
            enable_prefix_caching=False,
            speculative_config=self.speculative_config(),
        )
        self.model = self._llm.model

    def run(self, ids: torch.Tensor) -> Decoded:
        """Greedy decode as the others, each token's time taken where the engine picks it.
        A short call first compiles (or loads) the step of a new batch size, untimed."""
        from offload.engine.sampling_params import SamplingParams

        num_tokens = self.prepared.workload.output_len
        prompts = [{"prompt_token_ids": row} for row in ids.tolist()]
        if len(prompts) not in self._ready:
            warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
            self._llm.generate(prompts, warm, use_tqdm=False)
            self._llm.wait_for_compiles()  # (made in the background: the timed run's own)
            self._ready.add(len(prompts))
            self.num_forwards += 2
        times: list[float] = []  # when each token was picked (a turn's tokens: at its end)

        def picked(sequences) -> None:
            synchronize(self.device)
            now, made = time.perf_counter(), len(sequences[0].tokens) if sequences else 1
            times.extend([now] * max(1, made - len(times)))

        params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
        self._llm._on_step = picked
        started = time.perf_counter()
        try:
            outputs = self._llm.generate(prompts, params, use_tqdm=False)
        finally:
            self._llm._on_step = None
        tokens = torch.tensor([out.outputs[0].token_ids for out in outputs])
        steps = _spread([after - before for before, after in itertools.pairwise(times)])
        self.num_forwards += num_tokens
        return Decoded(tokens, times[0] - started, steps[: num_tokens - 1])

    def figures(self) -> Figures:
        return Figures()

    def close(self) -> None:
        if self._llm is not None:
            self._llm.close()
            self._llm = None
        super().close()


def _spread(gaps: list[float]) -> list[float]:
    """Gaps between tokens picked, where the tokens of one turn (speculation) share its
    time: a gap of 0 takes its share of the turn's gap before it."""
    spread, index = list(gaps), 0
    while index < len(spread):
        end = index + 1
        while end < len(spread) and spread[end] == 0:
            end += 1
        share = spread[index] / (end - index)
        spread[index:end] = [share] * (end - index)
        index = end
    return spread


class EngineNgram(Engine):
    name = "llm-ngram"
    label = "offload's LLM engine, resident, speculating by n-gram lookup (k as it pays)"

    def speculative_config(self) -> dict[str, Any] | None:
        return {"method": "ngram"}


class EngineDraft(Engine):
    name = "llm-draft"
    label = "offload's LLM engine, resident, the model's GGUF as stored drafting (k as it pays)"

    def speculative_config(self) -> dict[str, Any] | None:
        if self.prepared.gguf is None:
            raise MethodUnavailable("llm-draft: the model was not made from a GGUF to draft with")
        return {"method": "draft_model", "model": str(self.prepared.gguf), "quantization": "gguf"}
