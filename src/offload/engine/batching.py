"""Continuous batching: requests join the running batch at step boundaries and leave it
as soon as they finish, so every weight stream serves all of them.

One thread runs the model. Each turn: take new requests, drop cancelled ones, admit a
waiting one into free rows of a `RowCache` and prefill it (in chunks of
`max_num_batched_tokens`), then one decode step of every running sequence. A request that
can never fit is refused at once; one that does not fit now waits. What a request has so
far goes to its `emit` callback after every step that changed it.
"""

from __future__ import annotations

import atexit
import functools
import threading
import weakref
from collections import deque
from collections.abc import Callable

import torch

from offload.engine import cpu_linear, invariant
from offload.engine.cpu_linear import kernels_for
from offload.engine.requests import EngineModel, Group, Row, Submitted, check_fits
from offload.engine.rows import MIN_ROWS, RowCache, RowStep, read_width
from offload.engine.transformers_cache import cache_argument
from offload.errors import ConfigError, OffloadError
from offload.sizes import compute_dtype


class BatchingEngine:
    """Runs submitted requests in continuous batches of at most `max_rows` sequences of at
    most `max_len` tokens (prompt and output) each."""

    def __init__(
        self,
        runner: EngineModel,
        max_rows: int,
        max_len: int,
        max_num_batched_tokens: int | None = None,
        kv_dims=None,
        own_thread: bool = True,
        invariant: bool = False,
    ):
        self._runner = runner
        dtype = compute_dtype(runner.model)
        self._cache = RowCache(
            runner.model.config, max_rows, max_len, dtype, runner.device, kv_dims
        )
        self.max_rows, self.max_len = max_rows, max_len
        self._chunk_tokens = max_num_batched_tokens
        # Batch invariance (`invariant.py`): every step runs the eager products the model's
        # linears were padded for (no kernel chosen by row count, no compiled step). (Each
        # request prefills alone in any mode.)
        self.invariant = invariant
        self._inbox: deque[Submitted] = deque()
        self._waiting: deque[Submitted] = deque()
        self._running: list[Row] = []  # rows [0, len)
        self._group: Group | None = None
        self._turn_tokens: int | None = None  # prefill tokens left this turn (None: any)
        self._wake = threading.Condition()
        self._stop = False
        self.last_error: BaseException | None = None  # of the last forward; None once one works
        self._thread: threading.Thread | None = None
        self._at_exit: Callable[[], None] | None = None
        if own_thread:  # else the owner calls run() in a thread of its choosing
            self._thread = threading.Thread(target=self.run, name="offload-batching", daemon=True)
            self._thread.start()
            # An engine never closed is closed at exit: CPython ends a daemon thread that is
            # still inside torch's C++ by aborting the process ("terminate called without an
            # active exception", status 134). Weakly: the hook keeps no engine alive.
            self._at_exit = functools.partial(_close_at_exit, weakref.ref(self))
            atexit.register(self._at_exit)

    # -- what callers see ------------------------------------------------------------

    def submit_all(self, requests: list[Submitted]) -> None:
        """Queue `requests` at once: the next turn sees all of them, whatever the timing."""
        for request in requests:
            check_fits(request, self.max_rows, self.max_len)
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
        return len({id(r.request) for r in self._running if r.is_live})

    @property
    def num_waiting(self) -> int:
        return len(self._inbox) + len(self._waiting) + (self._group is not None)

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

    # -- the loop ---------------------------------------------------------------------

    def run(self) -> None:
        """The loop, until `close`: in the engine's own thread, or (`own_thread=False`)
        in the caller's. On a CPU the main thread runs it fastest: OpenMP spins its
        workers only while one thread leads teams (see `offload serve`)."""
        while True:
            with self._wake:
                while not self._stop and not self._has_work():
                    self._wake.wait(timeout=1.0)
                if self._stop:
                    break
                self._waiting.extend(self._inbox)
                self._inbox.clear()
            self._guarded_turn()
        self._fail_all(OffloadError("the server is shutting down"))

    def drain(self) -> None:
        """Run turns on the caller's thread until every submitted request is done (an
        engine made with `own_thread=False`, whose caller holds the model already: `LLM`'s
        generate in batch-invariant mode). An error of the engine's own ends the requests
        it met, as in `run`."""
        while True:
            with self._wake:
                self._waiting.extend(self._inbox)
                self._inbox.clear()
            if not self._has_work():
                return
            self._guarded_turn()

    def _guarded_turn(self) -> None:
        try:
            self._turn()
        except Exception as error:  # the engine's own fault: no request may wait on it
            self.last_error = error
            self._fail_all(error)
            self._waiting.clear()
            self._running, self._group = [], None

    def _has_work(self) -> bool:
        return bool(self._inbox or self._waiting or self._running or self._group)

    def _turn(self) -> None:
        """Prefills (each waiting request alone, one after another, while rows are free
        and the turn's `max_num_batched_tokens` last), then one decode step of every
        running sequence: requests that arrive together decode together."""
        self._drop_cancelled()
        self._turn_tokens = self._chunk_tokens
        while self._turn_tokens is None or self._turn_tokens > 0:
            if self._group is None:
                self._pack()
                self._group = self._admit()
            if self._group is None:
                break
            self._run_forward(self._group_rows(), self._prefill_chunk)
            if self._group is not None:  # (its prompt's rest at the next turns)
                break
        if any(row.is_live for row in self._running):
            self._run_forward(self._running, self._decode_step)

    def _group_rows(self) -> list[Row]:
        return self._group.rows if self._group is not None else []

    def _run_forward(self, rows: list[Row], forward: Callable[[], None]) -> None:
        """One forward; if it fails (a disk fault, a sampling error), its requests fail
        with the error and the others go on."""
        try:
            with self._runner.lock:
                forward()
            self.last_error = None
        except Exception as error:
            self.last_error = error
            if forward == self._prefill_chunk:
                self._group = None
            for request in {id(r.request): r.request for r in rows}.values():
                self._fail(request, error)

    def _drop_cancelled(self) -> None:
        self._waiting = deque(r for r in self._waiting if not r.cancelled)
        for row in self._running + self._group_rows():
            if row.request.cancelled and row.sequence.finish_reason is None:
                row.sequence.finish_reason = "abort"

    def _pack(self) -> None:
        """Running rows move into the rows of finished ones: they stay at the front."""
        keep = [row for row in self._running if row.is_live]
        moved = []
        for target, row in enumerate(keep):
            source = self._running.index(row)
            if source != target:
                moved.append((source, target, row.column))
        for source, target, num_columns in moved:
            self._cache.move_row(source, target, num_columns)
        self._running = keep

    def _admit(self) -> Group | None:
        """The first waiting request into free rows, its prompt at column 0, prefilled
        alone: prompts prefilled together are padded to one width, which moves a prompt's
        logits (`row_prefill`). (`check_fits` saw that it fits `max_len`.)"""
        if not self._waiting:
            return None
        if len(self._waiting[0].sequences) > self.max_rows - len(self._running):
            return None
        request = self._waiting.popleft()
        width = len(request.prompt_ids)
        rows = [Row(request, sequence, 0, width) for sequence in request.sequences]
        return Group(len(self._running), rows, width)

    # -- forwards ---------------------------------------------------------------------

    def _prefill_chunk(self) -> None:
        group = self._group
        num = len(group.rows)
        budget = self._turn_tokens
        step = group.width if budget is None else max(1, budget // num)
        start, end = group.done_columns, min(group.done_columns + step, group.width)
        if budget is not None:
            self._turn_tokens = budget - (end - start) * num
        device = self._runner.device
        columns = torch.arange(start, end, device=device)  # [tokens]
        starts = torch.tensor([row.start for row in group.rows], device=device)  # [rows]
        ids = [[self._runner.pad_id] * row.start + row.sequence.prompt_ids for row in group.rows]
        input_ids = torch.tensor(ids, device=device)[:, start:end]  # [rows, tokens]
        width = self._read_width(group.width)
        every = torch.arange(width, device=device)
        mask = ((every[None, :] >= starts[:, None]) & (every[None, :] < group.width)).long()
        self._cache.select(group.first, group.first + num, columns.expand(num, -1), start, width)
        logits = self._forward(
            input_ids, mask, (columns[None, :] - starts[:, None]).clamp(min=0), columns
        )
        group.done_columns = end
        if end < group.width:
            return
        self._group = None
        self._running.extend(group.rows)
        self._pick(group.rows, logits)

    @torch.inference_mode()
    def _decode_step(self) -> None:
        rows = self._running
        # (its inputs made in inference mode, as the warm-up's: a compiled step's guards
        # check each input's dispatch keys, and a step made outside it missed the graph)
        step = self._row_step(rows)
        compiled, logits, counted = self._runner.compiled, None, False
        if compiled is not None and step.compiled and compiled.usable(step):
            logits = compiled(step)  # (None while it compiles in the background)
            counted = logits is not None and compiled.usable(step)  # (known after a call)
        if logits is None:
            with invariant.decoding(len(rows)) if self.invariant else self._kernels():
                logits = step()
        logits = logits[: len(rows)]  # (less the padding rows)
        self._runner.on_forward(counted)
        for row in rows:
            row.column += row.is_live
        self._pick(rows, logits)

    def _row_step(self, rows: list[Row], pad_to: int = 0) -> RowStep:
        """The decode step of `rows`: compiled where the runner has a compiled step and
        there are at most `cpu_linear.MAX_ROWS` of them. `pad_to`: padding rows
        up to that many (copies of the first row, or of an empty one), which write only the
        column past `max_len` (the warm-up's step is all padding)."""
        device = self._runner.device
        last = [row.sequence.tokens[-1] if row.sequence.tokens else 0 for row in rows]
        # (a finished row still in the batch rewrites its last column: never past the end)
        at = [min(row.column, self.max_len - 1) for row in rows]
        starts = [row.start for row in rows]
        width = self._read_width(max(at, default=0) + 1)
        pad = max(pad_to - len(rows), 0)
        compiled = len(rows) + pad <= cpu_linear.MAX_ROWS
        compiled = compiled and self._runner.compiled is not None and not self.invariant
        last, at, starts = ([*values, *(values or [0])[:1] * pad] for values in (last, at, starts))
        columns = torch.tensor(at, device=device)[:, None]  # [rows, 1]
        start = torch.tensor(starts, device=device)[:, None]  # [rows, 1]
        every = torch.arange(width, device=device)
        mask = ((every[None, :] >= start) & (every[None, :] <= columns)).long()
        positions = columns - start
        columns[len(rows) :] = self.max_len  # padding rows write past what is read
        input_ids = torch.tensor(last, device=device)[:, None]
        model = self._runner.model
        return RowStep(model, self._cache, input_ids, mask, positions, columns, compiled)

    def warm_up(self) -> None:
        """Start the compiled decode steps (a lone row's and the batches', with padding
        rows only) now, before a request meets them (`offload serve` does, before it
        listens): loaded or compiled in the background (steps run eagerly until then), or
        here where they compile in the foreground (`OFFLOAD_CPU_COMPILE=wait`)."""
        if self._runner.compiled is None or self.invariant:
            return
        with self._runner.lock, torch.inference_mode():
            for rows in (1, MIN_ROWS):
                self._runner.compiled(self._row_step([], pad_to=rows))

    def _forward(self, input_ids, mask, position_ids, cache_position) -> torch.Tensor:
        model = self._runner.model
        with torch.inference_mode(), self._kernels():
            out = model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=position_ids,
                **cache_argument(model, self._cache.cache),
                cache_position=cache_position,
                use_cache=True,
                logits_to_keep=1,
            )
        self._runner.on_forward(False)
        return out.logits[:, -1, :]  # [rows, vocab]

    def _read_width(self, num_columns: int) -> int:
        """The columns attention reads; every one in batch-invariant mode (how many there
        are changes how its sums group, and the others' lengths would set it)."""
        return self.max_len if self.invariant else read_width(num_columns, self.max_len)

    def _kernels(self):
        """On a CPU a batch's linears run as weight @ x.T (see cpu_linear: MKL repacks the
        weight for a few rows) where the float32 weights are large enough for it to pay.
        (A batch-invariant decode step runs in `invariant.decoding` instead.)"""
        return kernels_for(self._runner.model, self._runner.device)

    def _pick(self, rows: list[Row], logits: torch.Tensor) -> None:
        """Each live row's next token; a row whose sampling fails fails its request."""
        live = [i for i, row in enumerate(rows) if row.is_live]
        if not live:
            return
        sequences = [rows[i].sequence for i in live]
        try:
            self._runner.steps.pick(logits[live], sequences)
        except ConfigError:
            for i in live:  # one at a time, to fail only the request that caused it
                try:
                    if rows[i].is_live:
                        self._runner.steps.pick(logits[i : i + 1], [rows[i].sequence])
                except ConfigError as error:
                    self._fail(rows[i].request, error)
        for request in {id(rows[i].request): rows[i].request for i in live}.values():
            if not request.failed:
                request.emit(request.output())

    def _fail(self, request: Submitted, error: BaseException) -> None:
        if request.failed:
            return
        request.failed = True
        for sequence in request.sequences:
            if sequence.finish_reason is None:
                sequence.finish_reason = "abort"
        request.emit(error)

    def _fail_all(self, error: BaseException) -> None:
        pending = list(self._inbox) + list(self._waiting)
        pending += [row.request for row in self._running + self._group_rows()]
        for request in {id(r): r for r in pending}.values():
            if any(s.finish_reason is None for s in request.sequences):
                self._fail(request, error)


def _close_at_exit(engine: weakref.ref[BatchingEngine]) -> None:
    alive = engine()
    if alive is not None:
        alive.close()
