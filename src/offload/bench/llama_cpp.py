"""llama.cpp beside us, on the same GGUF file: `llama-cpp-python` (a separate install: it
builds llama.cpp from source), with as many threads as torch uses here. Its Python API
decodes one sequence at a time, so a batch of B is B sequences one after another, and a
step's time is what all B took to get one more token each."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from offload.bench.decode import Decoded
from offload.bench.method import Figures, Method, MethodUnavailable


class LlamaCpp(Method):
    name = "llama-cpp"
    label = "llama.cpp (llama-cpp-python), the same GGUF, the same threads, one sequence at a time"

    def setting(self) -> dict[str, Any]:
        gguf = self.prepared.gguf
        return {"gguf": gguf.name if gguf else None, "n_threads": torch.get_num_threads()}

    def load(self) -> None:
        if self.prepared.gguf is None:
            raise MethodUnavailable("llama.cpp runs GGUF files: --model must be a .gguf file")
        if self.device.type != "cpu":
            raise MethodUnavailable("llama.cpp is run on the CPU only, beside a CPU workload")
        try:
            import llama_cpp
        except ImportError:
            raise MethodUnavailable(
                "llama-cpp-python is not installed (pip install llama-cpp-python; it builds "
                "llama.cpp from source)"
            ) from None
        workload = self.prepared.workload
        threads = torch.get_num_threads()
        self._logits_of = llama_cpp.llama_get_logits
        positions = workload.prompt_len + workload.output_len + 8
        self.model = llama_cpp.Llama(  # type: ignore[assignment]
            model_path=str(self.prepared.gguf),
            n_ctx=positions,
            n_batch=positions,  # (its logits are kept in n_batch rows, indexed by position)
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )

    def run(self, ids: torch.Tensor) -> Decoded:
        llama: Any = self.model
        num_tokens = self.prepared.workload.output_len
        tokens, prefill_s, step_s = [], 0.0, [0.0] * (num_tokens - 1)
        for row in ids.tolist():
            llama.reset()
            started = time.perf_counter()
            llama.eval(row)
            chosen = [self._greedy(llama)]
            prefill_s += time.perf_counter() - started
            for step in range(num_tokens - 1):
                started = time.perf_counter()
                llama.eval(chosen[-1:])
                chosen.append(self._greedy(llama))
                step_s[step] += time.perf_counter() - started
            tokens.append(chosen)
        self.num_forwards += num_tokens * len(tokens)
        return Decoded(torch.tensor(tokens), prefill_s, step_s)

    def _greedy(self, llama: Any) -> int:
        """The most likely next token after the last `eval`: its last position's logits, as
        llama.cpp's context holds them (`Llama.scores` is filled only with logits_all)."""
        logits = self._logits_of(llama.ctx)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(llama.n_vocab(),))))

    def figures(self) -> Figures:
        return Figures()  # (it maps the file and keeps it: nothing is offloaded)

    def close(self) -> None:
        if self.model is not None:
            self.model.close()  # type: ignore[operator]
        super().close()
