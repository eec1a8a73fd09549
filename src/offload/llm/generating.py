"""`LLM.generate` and `LLM.chat` on an engine core run on the caller's thread: every
request submitted at once, then the core's turns until all are done — the scheduler's
case "everything admitted, no arrivals", with the same steps `offload serve` runs.

The core's rows are sized to what a call needs (its sequences, the longest prompt plus
output, each rounded up to a power of two so that a few compiled steps serve every
call), within the KV room, and kept for the next call; a call that needs more makes
them larger. On a CPU the rows' memory is lent as they write it and given back at the
end of each call (`RowCache.release`), but for the prompts prefix caching holds.
"""

from __future__ import annotations

from collections.abc import Callable

from offload.engine.core import EngineCore
from offload.engine.cpu_step import cache_length
from offload.engine.kv_room import row_pages
from offload.engine.request_maker import RequestMaker
from offload.engine.requests import Submitted
from offload.engine.rows import MIN_ROWS
from offload.engine.sampling_params import SamplingParams
from offload.engine.sequences import RequestOutput, RequestProgress, SequenceState
from offload.engine.transfer_stats import TransferStats
from offload.errors import ConfigError

OnStep = Callable[[list[SequenceState]], None]


class Generating:
    """`make_core(rows, length, rounded, room, lanes)` makes a core (own_thread False) of that
    many rows of that many positions (`rounded`: a length of `cache_length`'s, for which a
    compiled step is made; another one, where the rounded one does not fit, decodes
    eagerly; `room`: the positions they hold together, or None); `room()` gives the bytes
    its KV cache may take and where that comes from, `per_position` the bytes of one
    position of one row; `too_big(rows, length)` raises the error for rows that do not fit
    (None: the plain one). `page`: where rows take memory as they write, the columns of a
    page (`page_columns`): then every row runs within the room, preempted where need be.
    `lanes`: micro-batches over a pipeline (`micro_batches`): `make_core(..., lanes)`
    then makes that many cores, each with its share of the rows and the room, where each
    share holds the call's widest request (else one core runs the call)."""

    def __init__(
        self,
        requests: RequestMaker,
        make_core: Callable[[int, int, bool, int | None, int], EngineCore],
        room: Callable[[], tuple[int, str]],
        per_position: int,
        max_num_seqs: int,
        too_big: Callable[[int, int], None] | None = None,
        page: int | None = None,
        lanes: int = 1,
    ):
        self._page = page
        self._lanes = lanes
        self._requests = requests
        self._make_core = make_core
        self._room = room
        self._per_position = per_position
        self._max_num_seqs = max_num_seqs
        self._too_big = too_big
        self.core: EngineCore | None = None
        self._moved = TransferStats()  # what cores closed moved (`core_moved`)

    def run(
        self,
        prompts,
        ids,
        params: list[SamplingParams],
        use_tqdm: bool | Callable = False,
        on_step: OnStep | None = None,
    ) -> list[RequestOutput]:
        """Every prompt as one request, all checked before any runs; their outputs in
        order, or the first error one met. `use_tqdm`: vLLM's bar of processed prompts;
        `on_step(sequences)` after each step that gave tokens."""
        errors: list[BaseException] = []

        def keep_errors(item: RequestOutput | BaseException) -> None:
            if isinstance(item, BaseException):
                errors.append(item)

        requests = [
            self._requests.request(str(number), text, prompt_ids, request, keep_errors, number)
            for number, (text, prompt_ids, request) in enumerate(
                zip(prompts, ids, params, strict=True)
            )
        ]
        sequences = [sequence for request in requests for sequence in request.sequences]
        if not sequences:
            return [request.output() for request in requests]
        core = self._core_for(requests)
        progress = RequestProgress(sequences, use_tqdm)

        def stepped() -> None:
            progress.update()
            if on_step is not None:
                on_step(sequences)

        core.on_step = stepped
        try:
            core.submit_all(requests)
            core.drain()
        except BaseException as error:  # (Ctrl-C: nothing of this call runs on)
            core.abandon(error)
            raise
        finally:
            core.on_step = None
            progress.close()
            for one in getattr(core, "cores", [core]):
                _end_call(one)
        if errors:
            raise errors[0]
        return [request.output() for request in requests]

    def _core_for(self, requests: list[Submitted]) -> EngineCore:
        """The core, made or made larger where this call needs more rows or positions."""
        sequences = [s for request in requests for s in request.sequences]
        exact = max(len(s.prompt_ids) + s.limit for s in sequences)
        length = cache_length(exact, self._requests.max_model_len)
        widest = max(len(request.sequences) for request in requests)  # (one request's n)
        rows = _power_of_two(max(min(len(sequences), self._max_num_seqs), widest, MIN_ROWS))
        rows = min(rows, max(self._max_num_seqs, widest))
        core = self.core
        if core is not None:
            lane = getattr(core, "cores", [core])[0].max_rows
            if core.max_rows >= rows and core.max_len >= length and lane >= widest:
                return core
            rows, length = max(rows, core.max_rows), max(length, core.max_len)
        room, source = self._room()
        lanes = self._lanes_for(rows, length, room, widest)
        if lanes > 1:
            self.close()
            rounded = length == cache_length(length, self._requests.max_model_len)
            shared = room // self._per_position if self._page is not None else None
            self.core = self._make_core(-(-rows // lanes), length, rounded, shared, lanes)
            return self.core
        fit = self._fit(rows, length, room, widest)
        if fit < widest and exact < length and (core is None or core.max_len <= exact):
            length = exact  # (rows as long as asked, where the rounded ones do not fit)
            fit = self._fit(rows, length, room, widest)
        if fit < widest:
            if self._too_big is not None:
                self._too_big(widest, length)
            raise ConfigError(
                f"the KV cache of {widest} sequence(s) of {length} positions needs "
                f"{widest * length * self._per_position / 2**20:.1f} MiB, more than the "
                f"{room / 2**20:.1f} MiB there is room for ({source}); lower max_tokens or "
                "max_model_len"
            )
        self.close()  # (the smaller one's memory goes before the larger one's comes)
        rounded = length == cache_length(length, self._requests.max_model_len)
        shared = room // self._per_position if self._page is not None else None
        self.core = self._make_core(int(fit), length, rounded, shared, 1)
        return self.core

    def _lanes_for(self, rows: int, length: int, room: int, widest: int) -> int:
        """The micro-batches a call runs as: `lanes` where each one's share of the rows and
        of the room holds its widest request and all its rows, else 1."""
        if self._lanes == 1:
            return 1
        share = -(-rows // self._lanes)
        fits = self._fit(share, length, room // self._lanes, widest)
        return self._lanes if share >= widest and fits >= share else 1

    def _fit(self, rows: int, length: int, room: int, widest: int) -> int:
        """How many of `rows` rows of `length` positions run within `room` bytes: as many
        as fit at full length, or (where rows take memory as they write) all of them, if
        the widest request fits alone (a little more than its length each: `row_pages`)."""
        if self._page is None:
            return min(rows, room // (length * self._per_position))
        whole = room // (row_pages(length + 1, self._page) * self._per_position)
        return rows if whole >= widest else whole

    def moved(self) -> TransferStats:
        """What the cores' KV offload and graph replays moved so far."""
        return self._moved + (core_moved(self.core) if self.core is not None else TransferStats())

    def close(self) -> None:
        if self.core is not None:
            self.core.close()
            self._moved += core_moved(self.core)
            self.core = None


def _end_call(core: EngineCore) -> None:
    """No row runs: what they wrote goes back, but for the prompts prefix caching holds (a
    next call, a chat's next turn, starts from them, as vLLM's `LLM`)."""
    held = core.scheduler.held_columns()
    core.runner.release(held)
    core.scheduler.released(held)
    if held is None:  # (an interrupted call's `abandon` forgot them already)
        core.scheduler.forget_prefixes()
    core.runner.forget_step()  # (a kept step's guards checked once a call, at least)


def core_moved(core: EngineCore) -> TransferStats:
    """What `core`'s KV offload and its CUDA graphs' replays moved so far (the weights'
    eager copies are the offloader's to count); of each core where `core` is several
    (`MicroBatches`)."""
    if hasattr(core, "cores"):
        return sum((core_moved(one) for one in core.cores), TransferStats())
    kv, graphs = core.runner.cache.kv_offloader, core.runner.graphs
    moved = TransferStats() if kv is None else TransferStats.of(kv=kv.stats())
    return moved if graphs is None else moved + graphs.replayed


def _power_of_two(count: int) -> int:
    rounded = 1
    while rounded < count:
        rounded *= 2
    return rounded
