"""An `LLM`'s continuous-batching front (what `offload serve` and `LLM.stream` use):
requests from any thread join one running batch, and each gets its outputs as they grow."""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from offload.engine.core import EngineCore
from offload.engine.request_maker import RequestMaker
from offload.engine.requests import Submitted
from offload.engine.rows import bytes_per_row, page_columns
from offload.engine.sampling_params import SamplingParams
from offload.engine.sequences import RequestOutput
from offload.errors import ConfigError, OffloadError
from offload.llm.budget import kv_room_after
from offload.memory.host import available_ram_bytes
from offload.sizes import compute_dtype

_logger = logging.getLogger("offload")
_ids = itertools.count()


# The KV cache of the rows on a CPU with no budget given, at most (vLLM's default KV space
# there is 4 GiB too); on a GPU, half of what is free once the model is loaded.
CPU_KV_BYTES = 4 * 2**30
_SHORTEST_ROW = 2048  # positions a row keeps before fewer rows are run instead


@dataclass(frozen=True)
class RowPlan:
    rows: int
    length: int  # positions per row: prompt plus output at most
    room: int | None = None  # positions all rows hold together (None: each row its length)


def plan_rows(
    per_position: int, free_bytes: int, rows: int, max_model_len: int, fixed_length: bool
) -> RowPlan:
    """`rows` rows of `max_model_len` positions within the KV budget; when they do not fit,
    shorter rows (down to 2048 positions, unless `fixed_length`: the user asked for that
    length), then fewer rows. Each row reserves its length up front."""
    budget = free_bytes
    length = max_model_len
    if rows * length * per_position > budget and not fixed_length:
        length = max(min(max_model_len, _SHORTEST_ROW), budget // (rows * per_position))
    fit = min(rows, budget // (length * per_position))
    if fit < 1:
        raise ConfigError(
            f"one sequence of {length} positions needs {length * per_position / 2**20:.0f} MiB of "
            f"KV cache, more than the {budget / 2**20:.0f} MiB there is room for; lower "
            "max_model_len"
        )
    return RowPlan(int(fit), int(min(length, max_model_len)))


def kv_cache_room(llm: Any) -> tuple[int, str]:
    """The bytes the rows' KV cache may take, and where that comes from: on a CPU with a
    budget, what `cpu_memory_gb` leaves once the layer stack is placed (or its share
    given: `host_budget`); else `kv_cache_memory_bytes` where given; with KV offload (the
    rows in host memory), `swap_space` where given; else half the free device memory on a
    GPU, and half the available RAM up to `CPU_KV_BYTES` on a CPU or with KV offload."""
    if llm.host_budget is not None:
        return kv_room_after(llm.host_budget, llm.offloader), "of cpu_memory_gb"
    if llm.kv_cache_memory_bytes is not None:
        return llm.kv_cache_memory_bytes, "of kv_cache_memory_bytes"
    if llm.kv_offload and llm.swap_space_bytes:
        return llm.swap_space_bytes, "of swap_space"
    if llm.device.type == "cuda" and not llm.kv_offload:
        return torch.cuda.mem_get_info(llm.device)[0] // 2, "half the free device memory"
    return min(available_ram_bytes() // 2, CPU_KV_BYTES), "of RAM"


def takes_as_written(llm: Any) -> bool:
    """Whether `llm`'s rows take memory only as they write (`RowCache.takes_as_written`:
    on a CPU, not in KV offload's pinned pool): then its cores run `max_num_seqs` rows
    within a KV room of positions, preempting where they outgrow it (`Scheduler`)."""
    return llm.device.type == "cpu" and not llm.kv_offload


def room_plan(
    per_position: int, room_bytes: int, rows: int, max_model_len: int, fixed_length: bool, page: int
) -> RowPlan:
    """`rows` rows of `max_model_len` positions sharing a room of `room_bytes`; each as
    long as the room holds at most, a little less than all of it (`row_pages`)."""
    room = room_bytes // per_position
    longest = (room // page - 1) * page - 1  # (a sequence alone always fits: `check_fits`)
    if longest < max_model_len and (fixed_length or longest < 1):
        raise ConfigError(
            f"one sequence of {max_model_len} positions needs "
            f"{max_model_len * per_position / 2**20:.0f} MiB of KV cache, more than the "
            f"{room_bytes / 2**20:.0f} MiB there is room for; lower max_model_len"
        )
    return RowPlan(rows, min(longest, max_model_len), room)


def row_plan(llm: Any, rows: int, fixed_length: bool, share: int = 1) -> RowPlan:
    """How many rows of how many positions an `LLM`'s core runs (`plan_rows`, or
    `room_plan` where they take memory as they write), with a warning where fewer or
    shorter than asked; `share`: one of that many cores sharing the KV room evenly."""
    dtype = compute_dtype(llm.model)
    per_position = bytes_per_row(llm.model.config, 1, dtype)
    room_bytes, source = kv_cache_room(llm)
    if share > 1:
        room_bytes, source = room_bytes // share, f"1/{share} {source}, one micro-batch's"
    if takes_as_written(llm):
        page = page_columns(llm.model.config, dtype)
        plan = room_plan(per_position, room_bytes, rows, llm.max_model_len, fixed_length, page)
        if plan.length < llm.max_model_len:
            _logger.warning(
                "a sequence of %d positions would not fit in %.0f MiB of KV cache (%s): "
                "sequences of up to %d positions run, %d at once sharing it (set "
                "max_model_len to choose)",
                llm.max_model_len, room_bytes / 2**20, source, plan.length, plan.rows,
            )  # fmt: skip
        return plan
    plan = plan_rows(per_position, room_bytes, rows, llm.max_model_len, fixed_length)
    if plan.rows < rows or plan.length < llm.max_model_len:
        _logger.warning(
            "the KV cache of %d sequences of %d positions would not fit in %.0f MiB (%s): "
            "%d sequences of %d positions run at once (set max_num_seqs or max_model_len "
            "to choose)",
            rows, llm.max_model_len, room_bytes / 2**20, source, plan.rows, plan.length,
        )  # fmt: skip
    return plan


class Serving:
    """Submit requests from any thread to an `EngineCore`; they run in continuous batches,
    in the core's own thread (or in whichever thread calls `core.run()`). `requests`
    checks and sequences each one for rows of `max_model_len` positions; `probe_token`
    is the token a health probe sends."""

    def __init__(
        self, core: EngineCore, requests: RequestMaker, max_model_len: int, probe_token: int
    ):
        self.core = core
        self._requests = requests
        self.max_model_len = max_model_len  # what a request may hold here (prompt + output)
        self._probe_token = probe_token
        self._probe: _Probe | None = None

    def submit(self, *args, **kwargs) -> Submitted:
        """`prepare` one request, then queue it: `emit` gets its output after each step
        that changed it (the last one has `finished`), or the error that ended it."""
        request = self.prepare(*args, **kwargs)
        self.core.submit_all([request])
        return request

    def truncate(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt as it will run (`truncate_prompt_tokens` applied)."""
        return self._requests.truncate(prompt_ids, params)

    def prepare(
        self,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        emit: Callable[[RequestOutput | BaseException], None],
        request_id: str | None = None,
        index: int = 0,
    ) -> Submitted:
        """One request checked and ready for `core.submit_all` (`index`: its number in
        a call of several)."""
        request_id = request_id or f"req-{next(_ids)}"
        return self._requests.request(
            request_id, prompt, prompt_ids, params, emit, index, self.max_model_len
        )

    def stream(self, prompt: str | None, prompt_ids: list[int], params: SamplingParams):
        """The request's outputs as they grow (each one whole so far), ending with the
        finished one; closing the iterator early cancels the request."""
        outputs: queue.Queue = queue.Queue()
        request = self.submit(prompt, prompt_ids, params, outputs.put)
        return _drain(outputs, lambda: self.core.cancel(request))

    def healthy(self) -> bool:
        """False while the last forward failed (a disk fault, say). Then a one-token
        request is sent in the background: once the model reads again, it succeeds and
        health comes back without waiting for real traffic."""
        if self.core.last_error is None:
            return True
        if self._probe is None or self._probe.done.is_set():
            probe = _Probe()
            params = SamplingParams(temperature=0, max_tokens=1)
            with contextlib.suppress(ConfigError, OffloadError):
                self.submit(None, [self._probe_token], params, probe.emit)
                self._probe = probe
        return False

    def warm_up(self) -> None:
        """The compiled decode step of the batches compiled (or loaded from disk) now,
        rather than at the first decode step, where each request would wait on it."""
        self.core.warm_up()

    def close(self) -> None:
        self.core.close()


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
