"""The engine core: requests join the running batch at step boundaries and leave it as
soon as they finish, so every weight stream serves all of them (continuous batching).

A `Scheduler` decides each turn (who waits, which rows run, which prompt chunk is
prefilled), a `StepRunner` runs its forwards over the rows' KV cache, and the core turns
logits into tokens and each request's output (its `emit` callback, after every step that
changed it). The turns run on the core's own thread (`offload serve`, `LLM.stream`), on a
thread the owner chooses (`run`), or on the caller's until everything submitted is done
(`drain`). A request that can never fit is refused at once; one that does not fit now
waits.
"""

from __future__ import annotations

import atexit
import functools
import threading
import weakref
from collections import deque
from collections.abc import Callable

import torch

from offload.engine.chunk_pace import ChunkPace
from offload.engine.mixed_turn import MixedTurn
from offload.engine.requests import EngineModel, Group, Row, Submitted, check_fits
from offload.engine.scheduler import Scheduler
from offload.engine.spec_turn import SpecTurn
from offload.engine.speculative import Pace, depths_of
from offload.engine.step_runner import StepRunner
from offload.errors import ConfigError, OffloadError


class EngineCore:
    """Runs submitted requests in continuous batches of at most `max_rows` sequences of at
    most `max_len` tokens (prompt and output) each."""

    def __init__(
        self,
        model: EngineModel,
        max_rows: int,
        max_len: int,
        max_num_batched_tokens: int | None = None,
        kv_dims=None,
        own_thread: bool = True,
        invariant: bool = False,
        host_pool=None,
        graphs=None,
        prefix_caching: bool = False,
        room: int | None = None,
        speculator=None,
        pace: Pace | None = None,
    ):
        self._model = model
        # (`host_pool`: the KV cache in host memory, streamed per layer: KV offload)
        # (`graphs`: a `RowGraphs` maker, the decode steps as CUDA graphs: `StepRunner`)
        runner = StepRunner if model.pipeline is None else model.pipeline.runner
        self.runner = runner(model, max_rows, max_len, kv_dims, invariant, host_pool, graphs)
        # (`prefix_caching`: prompts start from the longest prefix a row holds: `prefixes`;
        # `room`: the columns all rows may hold together, where rows take memory as they
        # write: more rows than it holds at full length run, and requests are preempted
        # where they outgrow it)
        cache = self.runner.cache
        room = room if cache.takes_as_written else None
        self.scheduler = Scheduler(
            max_rows, max_num_batched_tokens, prefix_caching, room, cache.page_columns
        )
        self.max_rows, self.max_len = max_rows, max_len
        self.invariant = invariant
        # (`speculator`: guesses of the rows' next tokens, scored in one forward:
        # `speculative`; it guesses only where rows decode apart from a prompt's chunk)
        self.speculator = speculator
        pace = pace or Pace(depths_of(getattr(speculator, "config", None)))  # (an LLM's)
        spec = speculator is not None  # (else plain decode steps)
        self._spec = SpecTurn(self, speculator, pace, model.on_verified) if spec else None
        self.runner.mixes = self.runner.mixes and speculator is None
        self._chunks = MixedTurn(self, ChunkPace())  # (chunked prefill's turns)
        self._inbox: deque[Submitted] = deque()  # (from any thread, into the scheduler's)
        self._wake = threading.Condition()
        self._stop = False
        self.last_error: BaseException | None = None  # of the last forward; None once one works
        self._thread: threading.Thread | None = None
        self._looping = False  # (inside `run`)
        self._at_exit: Callable[[], None] | None = None
        # Called after the turn's prefills that gave first tokens, and after each decode
        # step (a progress bar, text shown as it grows, a benchmark's clock).
        self.on_step: Callable[[], None] | None = None
        self._picked = False
        if own_thread:  # else the owner calls run() in a thread of its choosing
            self._thread = threading.Thread(target=self.run, name="offload-engine", daemon=True)
            self._thread.start()
            # A core never closed is closed at exit: CPython ends a daemon thread that is
            # still inside torch's C++ by aborting the process ("terminate called without an
            # active exception", status 134). Weakly: the hook keeps no core alive.
            self._at_exit = functools.partial(_close_at_exit, weakref.ref(self))
            atexit.register(self._at_exit)

    # -- what callers see ------------------------------------------------------------

    def submit_all(self, requests: list[Submitted]) -> None:
        """Queue `requests` at once: the next turn sees all of them, whatever the timing."""
        for request in requests:
            check_fits(request, self.max_rows, self.max_len)
            self.scheduler.check_fits(request)
        with self._wake:
            if self._stop:
                raise OffloadError("the engine is shutting down")
            self._inbox.extend(requests)
            self._wake.notify()

    def cancel(self, request: Submitted) -> None:
        """Stop `request` at the next step boundary; its rows are freed."""
        request.cancelled = True
        with self._wake:
            self._wake.notify()

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return len(self._inbox) + self.scheduler.num_waiting

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the loop; requests not finished get an error. (Safe from a signal
        handler in the loop's own thread: the lock is reentrant, and nothing is joined.)"""
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout_s)
        if not self._looping:  # (else the loop ends its cache's copies as it returns)
            self.runner.close()

    def warm_up(self) -> None:
        """The compiled decode steps started before a request meets them (`StepRunner`)."""
        self.runner.warm_up()

    # -- the loop ---------------------------------------------------------------------

    def run(self) -> None:
        """The loop, until `close`: in the core's own thread, or (`own_thread=False`)
        in the caller's. On a CPU the main thread runs it fastest: OpenMP spins its
        workers only while one thread leads teams (see `offload serve`)."""
        self._looping = True
        try:
            while True:
                with self._wake:
                    while not self._stop and not self._has_work():
                        self._wake.wait(timeout=1.0)
                    if self._stop:
                        break
                    self._take_inbox()
                self.step()
            self._fail_all(OffloadError("the server is shutting down"))
        finally:
            self._looping = False
            self.runner.close()

    def drain(self, stop: threading.Event | None = None) -> None:
        """Run turns on the caller's thread until every submitted request is done (a core
        made with `own_thread=False`, whose caller holds the model already), or `stop` is
        set. An error of the core's own ends the requests it met, as in `run`."""
        while stop is None or not stop.is_set():
            with self._wake:
                self._take_inbox()
            if not self._has_work():
                return
            self.step()

    def step(self) -> None:
        """One turn; an error of the core's own fails every request (none may wait on it)."""
        try:
            self._turn()
        except Exception as error:
            self.last_error = error
            self._fail_all(error)
            self.scheduler.clear()

    def abandon(self, error: BaseException) -> None:
        """Every request not finished ends with `error`, and none runs on (the caller of
        `drain` was interrupted between two forwards, or inside one)."""
        with self._wake:
            self._fail_all(error)
            self._inbox.clear()
            self.scheduler.clear()

    def _take_inbox(self) -> None:
        self.scheduler.add(self._inbox)
        self._inbox.clear()

    def _has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work

    def _turn(self) -> None:
        """Prefills (the waiting requests admitted one after another, while rows are free
        and the turn's `max_num_batched_tokens` last; those whose prompts end this turn
        in one forward where the runner `packs`, else each alone), then one decode step
        of every running sequence: requests that arrive together decode together. While
        rows decode, the turn's prompt tokens ride in their step (`mixed_turn`): with
        `max_num_batched_tokens`, or where the runner `packs`, as `ChunkPace` measures."""
        scheduler = self.scheduler
        decoding = scheduler.decoding()
        fixed = scheduler.chunk_tokens is not None
        mixes = self.runner.mixes and bool(decoding) and (fixed or self.runner.packs)
        scheduler.begin_turn(self._chunks.budget(decoding) if mixes and not fixed else None)
        if mixes:
            self._chunks()
            return
        packed: list[tuple[Group, int, int]] = []  # (whole prompts: one forward for all)
        while True:
            group, moves = scheduler.next_group()
            self.runner.move_rows(moves)  # (packed whether or not a request is admitted)
            if group is None and packed:  # (the next may wait for their prefixes: again)
                packed = self._prefill_packed(packed)
                continue
            if group is None:
                break
            start, end = scheduler.next_chunk(group)
            if self.runner.packs and end == group.width and not group.every_position:
                scheduler.prefilled(group, end, computed=False)
                packed.append((group, start, end))
                continue
            packed = self._prefill_packed(packed)
            if not self._run_forward(group.rows, self._prefill, group, start, end):
                scheduler.drop_group()  # (its requests failed; the next one may start)
            elif group.done_columns < group.width:
                break  # (its prompt's rest at the next turns)
        self._stepped()
        self.runner.move_rows(scheduler.make_room())  # (a KV room: preempting, if need be)
        self.decode_turn(scheduler.decoding())

    def decode_turn(self, rows: list[Row]) -> None:
        """`rows`' decode step (or speculative turn), a plain one timed for `ChunkPace`."""
        if rows:
            began = self._chunks.pace.start()
            decode = self.decode if self._spec is None else self._spec
            if self._run_forward(rows, decode, rows) and self._spec is None:
                self._chunks.pace.decoded(began)
            self._stepped()

    def _stepped(self) -> None:
        if self._picked and self.on_step is not None:
            self.on_step()
        self._picked = False

    def _prefill(self, group: Group, start: int, end: int) -> None:
        self._prefilled(group, end, self.runner.prefill(group, start, end))

    def _prefill_packed(self, packed: list[tuple[Group, int, int]]) -> list:
        """The forward of whole prompts admitted this turn (`packed`, their rows already
        running): one for all where the runner can (`StepRunner.packs`), else one each;
        their first tokens picked. An empty list, for the caller's next ones."""
        rows = [row for group, _, _ in packed for row in group.rows]
        began = self._chunks.pace.start()
        if packed and not self._run_forward(rows, self._packed_forward, packed):
            self.scheduler.computed(done=False)  # (their requests failed: the rows leave)
        elif packed:
            tokens = sum(end - start for _, start, end in packed)
            self._chunks.pace.prefilled(tokens, began)
        return []

    def _packed_forward(self, packed: list[tuple[Group, int, int]]) -> None:
        found = (len(packed) > 1 and self.runner.prefill_packed(packed)) or [
            self.runner.prefill(*chunk) for chunk in packed
        ]  # (alone, or not now: a compile is tracing the model)
        self.scheduler.computed()
        for (group, _, _), logits in zip(packed, found, strict=True):
            self._whole(group, logits)

    def _prefilled(self, group: Group, end: int, logits: torch.Tensor) -> None:
        """The tokens of a prefill (or its chunk) up to column `end` are in; `logits` of
        its last column, or of every column (prompt logprobs)."""
        if group.every_position:  # [1, tokens, vocab]: kept till the prompt is whole
            group.chunks.append(logits)
        if self.scheduler.prefilled(group, end):
            self._whole(group, logits)

    def _whole(self, group: Group, logits: torch.Tensor) -> None:
        """`group`'s whole prompt is in its first row: copied to its others, and its first
        tokens picked (not a preempted request's: it has them)."""
        self.runner.copy_prompt(group)
        if group.resumed:  # (its tokens are known: its rows feed them back, `replaying`)
            return
        num = len(group.rows)
        sequences = [row.sequence for row in group.rows]
        if group.every_position:
            every = torch.cat(group.chunks, dim=1).expand(num, -1, -1)  # [rows, width, vocab]
            group.chunks.clear()
            self._model.steps.prompt_logprobs(every, sequences, group.width)
            logits = every[:, -1, :]
        self._pick(group.rows, logits.expand(num, -1))

    def decode(self, rows: list[Row]) -> None:
        """One decode step of `rows` and their tokens."""
        replaying = [row.replaying for row in rows]  # (before the step moves their columns)
        self._pick(rows, self.runner.decode(rows), replaying)

    def _run_forward(self, rows: list[Row], forward, *args) -> bool:
        """One forward and its tokens; if it fails (a disk fault, a sampling error), its
        requests fail with the error, the others go on, and False."""
        try:
            # (its tokens picked in inference mode too: the logits are inference tensors,
            # and banning tokens writes into them)
            with self._model.lock, torch.inference_mode():
                forward(*args)
            self.last_error = None
            return True
        except Exception as error:
            self.last_error = error
            for request in {id(r.request): r.request for r in rows}.values():
                self._fail(request, error)
            return False

    def _pick(self, rows: list[Row], logits, replaying: list[bool] | None = None) -> None:
        """Each live row's next token (not the rows `replaying` a preempted request's
        tokens); a row whose sampling fails fails its request."""
        live = [i for i, row in enumerate(rows) if row.is_live]
        if replaying is not None:
            live = [i for i in live if not replaying[i]]
        if not live:
            return
        self.choose([rows[i] for i in live], logits[live])
        self.emit([rows[i] for i in live])

    def choose(self, rows: list[Row], logits) -> list[int | None]:
        """The next token of each of `rows` (live) from `logits` [rows, vocab], appended to
        its sequence; None for a row whose sampling failed (its request fails)."""
        sequences = [row.sequence for row in rows]
        try:
            return self._model.steps.pick(logits, sequences).tolist()
        except ConfigError:
            tokens: list[int | None] = []
            for i, row in enumerate(rows):  # one at a time, to fail only the request that caused it
                try:
                    if not row.is_live:
                        tokens.append(None)
                        continue
                    picked = self._model.steps.pick(logits[i : i + 1], [row.sequence])
                    tokens.append(int(picked[0]))
                except ConfigError as error:
                    self._fail(row.request, error)
                    tokens.append(None)
            return tokens

    def emit(self, rows: list[Row]) -> None:
        for request in {id(row.request): row.request for row in rows}.values():
            if not request.failed:
                request.emit(request.output())
        self._picked = True

    def _fail(self, request: Submitted, error: BaseException) -> None:
        if request.failed:
            return
        request.failed = True
        for sequence in request.sequences:
            if sequence.finish_reason is None:
                sequence.finish_reason = "abort"
        request.emit(error)

    def _fail_all(self, error: BaseException) -> None:
        for request in [*self._inbox, *self.scheduler.pending()]:
            if any(s.finish_reason is None for s in request.sequences):
                self._fail(request, error)


def _close_at_exit(core: weakref.ref[EngineCore]) -> None:
    alive = core()
    if alive is not None:
        alive.close()
