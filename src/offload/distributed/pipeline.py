"""Rank 0's side of a pipeline: its engine cores' step runners (`PipelinedRunner`) tell the
other ranks each call before running it on their own stage, and take the logits of each
forward from the last rank; the other ranks repeat the calls (`worker.StageWorker`).
Every rank runs the same runner code on the same rows, so each layer computes what it
would in one process, and rank 0 samples from the last rank's logits as one process
would.

Calls are launched one at a time (a lock: a call's message and hidden states are never
interleaved with another's), and a forward's logits are taken in the order the forwards
were launched, outside that lock: while the other ranks work on one engine core's
forward, rank 0 launches another core's (micro-batches in flight, `engine.micro_batches`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from offload.distributed.channel import Channel, PipelineError
from offload.distributed.cut import Link
from offload.distributed.join import Member, first_dead, leave
from offload.distributed.messages import (
    Busy,
    Close,
    CopyPrompt,
    Decode,
    ForgetStep,
    GroupView,
    KeepPaths,
    Message,
    Mixed,
    MoveRows,
    Open,
    Ping,
    Prefill,
    PrefillPacked,
    Ready,
    Release,
    Report,
    RowView,
    Stop,
    Verify,
    encode,
    flat_logits,
)
from offload.engine.spec_tree import Tree
from offload.engine.step_runner import StepRunner

_BEAT_S = 10.0  # a message at least this often, calls or not (the others' waits time out)


class Pipeline:
    """Rank 0 of `member`'s pipeline, its stage's hidden states through `link`."""

    def __init__(self, member: Member, link: Link, pools: tuple = (None, None)):
        self.member, self.link = member, link
        # (KV offload pools by number, `pool_number`: `generate`'s, the serving core's)
        self._pools: list[Any] = list(pools)
        self._lock = threading.Lock()
        # Forwards launched, and the next one whose logits come back (in launch order).
        self._launched, self._landed = 0, 0
        self.most_in_flight = 0  # forwards launched at once whose logits had not come
        self.busy_s = 0.0  # this rank's stage computing forwards (`busy`)
        self._turns = threading.Condition()
        self._ids = itertools.count(1)
        self.broken: str | None = None
        self.on_broken: Callable[[], None] | None = None  # (a server stops: `offload serve`)
        self._closed = threading.Event()
        self._sent_at = time.monotonic()
        ref = weakref.ref(self)  # (the thread keeps no pipeline alive)
        self._beat = threading.Thread(target=_beating, args=(ref,), name="offload-pipeline")
        self._beat.daemon = True
        self._beat.start()
        # Rank 0 ending without close(): the others are told to stop, not left to find
        # their connection closed.
        self._at_exit = functools.partial(_close_at_exit, ref)
        atexit.register(self._at_exit)

    @property
    def size(self) -> int:
        return self.member.stage.size

    def wait_ready(self) -> None:
        """Every other rank's stage loaded; its error, naming it, where one failed."""
        for rank in range(1, self.size):
            ready = self.member.recv(rank)
            if not isinstance(ready, Ready):
                raise PipelineError(f"pipeline rank {rank} sent {type(ready).__name__} first")
            if ready.error is not None:
                raise PipelineError(f"pipeline rank {rank}: {ready.error}")

    def runner(self, model, max_rows, max_len, kv_dims=None, invariant=False, host_pool=None, graphs=None):  # fmt: skip
        """An engine core's step runner (what `EngineCore` makes where its model has a
        pipeline); no CUDA graphs (a step's sends and receives are not captured)."""
        return PipelinedRunner(self, model, max_rows, max_len, kv_dims, invariant, host_pool)

    def new_id(self) -> int:
        return next(self._ids)

    def tell(self, message: Message, cleanup: bool = False) -> None:
        """`message` to every other rank (no answer). `cleanup`: a runner's memory given
        back, skipped where the pipeline is broken (the caller's own part still runs)."""
        with self._lock:
            if cleanup and (self.broken is not None or self._closed.is_set()):
                return
            self._check()
            with self._breaking():
                self._broadcast(message)

    def pool_number(self, pool: Any) -> int:
        """The number the other ranks know `pool` by (a runner's KV offload pool: 1 is
        the serving core's, 0 any `generate` core's, more for micro-batch cores)."""
        for number, known in enumerate(self._pools):
            if known is pool:
                return number
        self._pools.append(pool)
        return len(self._pools) - 1

    def run(self, message: Message, local: Callable[[], Any], unlocked: Any = None) -> Any:
        """A forward: `message` to every other rank, `local()` on this stage (its hidden
        states sent on as its last layer ends), then the last rank's logits in place of
        the local call's (a tensor or a tuple of them, of the same shapes). While they
        come, `unlocked` (a lock the caller holds: its model's) is let go, so that
        another core launches its forward meanwhile."""
        with self._lock:
            self._check()
            with self._breaking():
                self._broadcast(message)
                start = time.perf_counter()
                with self.link.live():
                    result = local()
                self.busy_s += time.perf_counter() - start
            turn, self._launched = self._launched, self._launched + 1
            self.most_in_flight = max(self.most_in_flight, self._launched - self._landed)
        single = isinstance(result, torch.Tensor)
        tensors = [result] if single else list(result)
        with _let_go(unlocked), self._breaking():
            received = self._logits(turn, tensors)
        return received[0] if single else tuple(received)

    def _logits(self, turn: int, like: list[torch.Tensor]) -> list[torch.Tensor]:
        """Forward `turn`'s logits from the last rank, once the earlier ones' came."""
        with self._turns:
            while self._landed != turn:
                self._check()
                self._turns.wait(timeout=1.0)
        try:
            self._check()
            last = self.size - 1
            return [
                self.member.channel.recv_tensor(last, Channel.LOGITS).to(t.device) for t in like
            ]
        finally:
            with self._turns:
                self._landed += 1
                self._turns.notify_all()

    def busy(self) -> list[float]:
        """Each rank's seconds computing its stage's forwards so far (the other ranks'
        once the forwards launched before are done; a rank's waits for the one before it
        apart): over a span of wall time, the part each rank was busy, and its bubbles."""
        with self._lock:
            self._check()
            with self._breaking():
                self._broadcast(Report())
                answers = [self.member.recv(rank) for rank in range(1, self.size)]
        for rank, answer in enumerate(answers, start=1):
            if not isinstance(answer, Busy) or answer.rank != rank:
                raise PipelineError(f"pipeline rank {rank} answered {answer!r} to a report")
        return [self.busy_s, *(answer.seconds for answer in answers)]

    def close(self) -> None:
        """The others told to stop (where they can be), the group left."""
        self._closed.set()
        atexit.unregister(self._at_exit)
        with self._lock:
            if self.broken is None:
                with contextlib.suppress(PipelineError):
                    self._broadcast(Stop())
                    # (written out before the group is left: a process that ends at once,
                    # `process_exit`, would close its sockets with the Stop unsent, and a
                    # torchrun rank would find its connection reset instead)
                    self.member.channel.flush()
            self.broken = self.broken or "this LLM is closed"
        leave(self.member)

    def _broadcast(self, message: Message) -> None:
        payload = encode(message)
        for rank in range(1, self.size):
            self.member.channel.send_bytes(payload, rank)
        self._sent_at = time.monotonic()

    def _check(self) -> None:
        if self.broken is not None:
            raise PipelineError(f"{self.broken}; close this LLM and make a new one")

    def _breaking(self):
        return _Breaking(self)

    def beat(self) -> None:
        """A `Ping` where nothing was sent for `_BEAT_S` and no call is under way."""
        if time.monotonic() - self._sent_at < _BEAT_S or self.broken is not None:
            return
        if self._lock.acquire(blocking=False):
            try:
                if self.broken is None and not self._closed.is_set():
                    with self._breaking():
                        self._broadcast(Ping())
                        self.member.channel.reap()  # (a rank gone: said now, not at the next call)
            except PipelineError:
                pass  # (said to the next call)
            finally:
                self._lock.release()


@contextlib.contextmanager
def _let_go(lock: Any):
    """`lock` (held by this thread) released inside, taken again after; nothing for a
    lock-less caller (`generate`'s core: a `nullcontext`)."""
    if not hasattr(lock, "release"):
        yield
        return
    lock.release()
    try:
        yield
    finally:
        lock.acquire()


def _beating(ref: weakref.ref[Pipeline]) -> None:
    while True:
        time.sleep(1.0)
        pipeline = ref()
        if pipeline is None or pipeline._closed.is_set():
            return
        pipeline.beat()
        del pipeline


def _close_at_exit(ref: weakref.ref[Pipeline]) -> None:
    pipeline = ref()
    if pipeline is not None:
        pipeline.close()


class _Breaking:
    """Any failure inside marks the pipeline broken: a rank that stopped (named: the first
    one started here that ended, else the one that did not answer), or a call left
    mid-way (an interrupt), after which the ranks' streams are no longer in step."""

    def __init__(self, pipeline: Pipeline):
        self.pipeline = pipeline

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace) -> bool:
        if error is None:
            return False
        if isinstance(error, PipelineError):
            time.sleep(0.2)  # (a rank that was killed: its process ends at once)
            dead = first_dead(self.pipeline.member)
            message = f"pipeline rank {dead} stopped" if dead is not None else str(error)
            self._broke(message)
            raise PipelineError(message) from None
        self._broke(f"the pipeline was left mid-step ({type(error).__name__})")
        return False

    def _broke(self, message: str) -> None:
        self.pipeline.broken = message
        if self.pipeline.on_broken is not None:
            self.pipeline.on_broken()


class PipelinedRunner(StepRunner):
    """A `StepRunner` on rank 0 whose every call the other ranks repeat on their stage."""

    decodes_as_prefills = False  # (rank 0 sees its own stage's attention only)

    def __init__(self, pipeline: Pipeline, model, max_rows, max_len, kv_dims, invariant, host_pool):
        super().__init__(model, max_rows, max_len, kv_dims, invariant, host_pool, None)
        self._pipeline, self._id = pipeline, pipeline.new_id()
        self._closed = False
        dims = list(kv_dims) if kv_dims is not None else None
        pool = None if host_pool is None else pipeline.pool_number(host_pool)
        pipeline.tell(Open(self._id, max_rows, max_len, dims, invariant, pool))

    def move_rows(self, moves) -> None:
        self._pipeline.tell(MoveRows(self._id, list(moves)))
        super().move_rows(moves)

    def copy_prompt(self, group) -> None:
        self._pipeline.tell(CopyPrompt(self._id, GroupView.of(group)))
        super().copy_prompt(group)

    def prefill(self, group, start: int, end: int) -> torch.Tensor:
        message = Prefill(self._id, GroupView.of(group), start, end)
        return self._run(message, lambda: super(PipelinedRunner, self).prefill(group, start, end))

    def prefill_packed(self, chunks):
        views = [GroupView.of(group) for group, _, _ in chunks]
        message = PrefillPacked(self._id, views, [[start, end] for _, start, end in chunks])
        local = super().prefill_packed
        return self._run(message, lambda: _packed(local(chunks)))

    def packed(self, rows, chunks):
        views = [GroupView.of(group) for group, _, _ in chunks]
        message = Mixed(self._id, _views(rows), views, [[start, end] for _, start, end in chunks])
        local = super().packed
        flat = self._run(message, lambda: flat_logits(_mixed(local(rows, chunks))))
        return flat[0], list(flat[1:])

    def verify(self, rows, guesses) -> torch.Tensor:
        trees = [g if g is None or isinstance(g, Tree) else Tree.chain(g) for g in guesses]
        message = Verify(self._id, _views(rows), trees)
        return self._run(message, lambda: super(PipelinedRunner, self).verify(rows, trees))

    def decode(self, rows) -> torch.Tensor:
        message = Decode(self._id, _views(rows))
        return self._run(message, lambda: super(PipelinedRunner, self).decode(rows))

    def _run(self, message, local):
        return self._pipeline.run(message, local, unlocked=self.model.lock)

    def keep_paths(self, rows, paths) -> None:
        self._pipeline.tell(KeepPaths(self._id, _views(rows), [list(p) for p in paths]))
        super().keep_paths(rows, paths)

    def forget_step(self) -> None:
        self._pipeline.tell(ForgetStep(self._id), cleanup=True)
        super().forget_step()

    def release(self, keep=None) -> None:
        self._pipeline.tell(Release(self._id, keep), cleanup=True)
        super().release(keep)

    def close(self) -> None:
        if not self._closed:  # (a core closes its runner once or twice: told once)
            self._closed = True
            self._pipeline.tell(Close(self._id), cleanup=True)
        super().close()


def _views(rows) -> list[RowView]:
    return [RowView.of(row) for row in rows]


def _packed(out):
    if out is None:  # (no compiled step on a stage: a packed forward always runs)
        raise PipelineError("a packed prefill could not run on rank 0's stage")
    return out


def _mixed(out):
    if out is None:  # (no compiled step on a stage: a mixed forward always runs)
        raise PipelineError("a mixed forward could not run on rank 0's stage")
    return out
