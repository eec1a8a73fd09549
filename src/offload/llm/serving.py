"""An `LLM`'s continuous-batching front (what `offload serve` and `LLM.stream` use):
requests from any thread join one running batch, and each gets its outputs as they grow."""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from offload.engine.batching import BatchingEngine, EngineModel, Submitted
from offload.engine.rows import bytes_per_row
from offload.engine.sampling_params import SamplingParams
from offload.engine.sequences import RequestOutput
from offload.errors import ConfigError, OffloadError
from offload.memory.host import available_ram_bytes

_logger = logging.getLogger("offload")
_ids = itertools.count()


def _rows_that_fit(llm: Any, rows: int) -> int:
    """`rows` sequences of `max_model_len` positions, or fewer if their KV cache would
    take more than half the memory free on the device now (with a warning)."""
    dtype = next(llm.model.parameters()).dtype
    per_row = bytes_per_row(llm.model.config, llm.max_model_len, dtype)
    if llm.device.type == "cuda":
        free = torch.cuda.mem_get_info(llm.device)[0]
    else:
        free = available_ram_bytes()
    fit = int(free * 0.5) // per_row
    if fit < 1:
        raise ConfigError(
            f"one sequence of max_model_len={llm.max_model_len} needs {per_row / 2**20:.0f} MiB "
            f"of KV cache, more than half the {free / 2**20:.0f} MiB free; lower max_model_len"
        )
    if fit < rows:
        _logger.warning(
            "max_num_seqs=%d sequences of %d positions do not fit in memory: %d run at once",
            rows, llm.max_model_len, fit,
        )  # fmt: skip
    return min(rows, fit)


class Serving:
    """Submit requests to `llm` from any thread; they run in continuous batches of at
    most `max_num_seqs` sequences."""

    def __init__(self, llm: Any, max_num_seqs: int | None = None):
        self._llm = llm
        if llm.kv_offload:
            raise ConfigError(
                "continuous batching keeps the KV cache on the device: kv_offload is not "
                "served yet (leave it off; weights may still be offloaded)"
            )
        rows = _rows_that_fit(llm, max_num_seqs or llm.max_num_seqs)
        runner = EngineModel(
            llm.model,
            llm._tokens,
            llm.device,
            llm.tokenizer.pad_token_id or 0,
            llm._lock,
            on_forward=self._count_forward,
        )
        self.engine = BatchingEngine(runner, rows, llm.max_model_len, llm.max_num_batched_tokens)
        self._probe: _Probe | None = None

    def _count_forward(self) -> None:
        self._llm._forwards += 1

    def submit(self, *args, **kwargs) -> Submitted:
        """`prepare` one request, then queue it: `emit` gets its output after each step
        that changed it (the last one has `finished`), or the error that ended it."""
        request = self.prepare(*args, **kwargs)
        self.engine.submit(request)
        return request

    def prepare(
        self,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        emit: Callable[[RequestOutput | BaseException], None],
        request_id: str | None = None,
    ) -> Submitted:
        """One request checked and ready for `engine.submit_all`."""
        prompt_ids = self._llm._truncate(prompt_ids, params)
        self._llm._check_request(prompt_ids, params)
        if params.prompt_logprobs is not None:
            raise ConfigError("prompt_logprobs is not served yet; leave it unset")
        sequences = self._llm._sequences([prompt_ids], [params])
        return Submitted(request_id or f"req-{next(_ids)}", prompt, prompt_ids, sequences, emit)

    def stream(self, prompt: str | None, prompt_ids: list[int], params: SamplingParams):
        """The request's outputs as they grow (each one whole so far), ending with the
        finished one; closing the iterator early cancels the request."""
        outputs: queue.Queue = queue.Queue()
        request = self.submit(prompt, prompt_ids, params, outputs.put)
        return _drain(outputs, lambda: self.engine.cancel(request))

    def healthy(self) -> bool:
        """False while the last forward failed (a disk fault, say). Then a one-token
        request is sent in the background: once the model reads again, it succeeds and
        health comes back without waiting for real traffic."""
        if self.engine.last_error is None:
            return True
        if self._probe is None or self._probe.done.is_set():
            probe = _Probe()
            params = SamplingParams(temperature=0, max_tokens=1)
            with contextlib.suppress(ConfigError, OffloadError):
                self.submit(None, [self._llm.tokenizer.eos_token_id or 0], params, probe.emit)
                self._probe = probe
        return False

    def close(self) -> None:
        self.engine.close()


class _Probe:
    def __init__(self):
        self.done = threading.Event()

    def emit(self, item) -> None:
        if isinstance(item, BaseException) or item.finished:
            self.done.set()


def _drain(outputs: queue.Queue, cancel: Callable[[], None]) -> Iterator[RequestOutput]:
    finished = False
    try:
        while not finished:
            item = outputs.get()
            if isinstance(item, BaseException):
                raise item
            finished = item.finished
            yield item
    finally:
        if not finished:
            cancel()
