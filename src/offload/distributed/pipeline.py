"""Rank 0's side of a pipeline: its engine cores' step runners (`PipelinedRunner`) tell the
other ranks each call before running it on their own stage, and take the logits of each
forward from the last rank; the other ranks repeat the calls (`worker.StageWorker`).
Every rank runs the same runner code on the same rows, so each layer computes what it
would in one process, and rank 0 samples from the last rank's logits as one process
would. Calls go one at a time (a lock): a call's message, its hidden states and its
logits are never interleaved with another's."""

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
    Ready,
    Release,
    RowView,
    Stop,
    Verify,
    encode,
)
from offload.engine.spec_tree import Tree
from offload.engine.step_runner import StepRunner

_BEAT_S = 10.0  # a message at least this often, calls or not (the others' waits time out)


class Pipeline:
    """Rank 0 of `member`'s pipeline, its stage's hidden states through `link`."""

    def __init__(self, member: Member, link: Link, serving_pool: Any = None):
        self.member, self.link = member, link
        self.serving_pool = serving_pool  # (the KV pool of serve's core, to tell the others)
        self._lock = threading.Lock()
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

    def run(self, message: Message, local: Callable[[], Any]) -> Any:
        """A forward: `message` to every other rank, `local()` on this stage (its hidden
        states sent on as its last layer ends), then the last rank's logits in place of
        the local call's (a tensor or a tuple of them, of the same shapes)."""
        with self._lock:
            self._check()
            with self._breaking():
                self._broadcast(message)
                with self.link.live():
                    result = local()
                single = isinstance(result, torch.Tensor)
                tensors = [result] if single else list(result)
                last = self.size - 1
                received = [
                    self.member.channel.recv_tensor(last, Channel.LOGITS).to(t.device)
                    for t in tensors
                ]
        return received[0] if single else tuple(received)

    def close(self) -> None:
        """The others told to stop (where they can be), the group left."""
        self._closed.set()
        atexit.unregister(self._at_exit)
        with self._lock:
            if self.broken is None:
                with contextlib.suppress(PipelineError):
                    self._broadcast(Stop())
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
            except PipelineError:
                pass  # (said to the next call)
            finally:
                self._lock.release()


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

    def __init__(self, pipeline: Pipeline, model, max_rows, max_len, kv_dims, invariant, host_pool):
        super().__init__(model, max_rows, max_len, kv_dims, invariant, host_pool, None)
        self._pipeline, self._id = pipeline, pipeline.new_id()
        self._closed = False
        serving = host_pool is not None and host_pool is pipeline.serving_pool
        dims = list(kv_dims) if kv_dims is not None else None
        kv = host_pool is not None
        pipeline.tell(Open(self._id, max_rows, max_len, dims, invariant, kv, serving))

    def move_rows(self, moves) -> None:
        self._pipeline.tell(MoveRows(self._id, list(moves)))
        super().move_rows(moves)

    def copy_prompt(self, group) -> None:
        self._pipeline.tell(CopyPrompt(self._id, GroupView.of(group)))
        super().copy_prompt(group)

    def prefill(self, group, start: int, end: int) -> torch.Tensor:
        message = Prefill(self._id, GroupView.of(group), start, end)
        return self._pipeline.run(
            message, lambda: super(PipelinedRunner, self).prefill(group, start, end)
        )

    def mixed(self, rows, group, start: int, end: int):
        message = Mixed(self._id, _views(rows), GroupView.of(group), start, end)
        local = super().mixed
        return self._pipeline.run(message, lambda: _mixed(local(rows, group, start, end)))

    def verify(self, rows, guesses) -> torch.Tensor:
        trees = [g if g is None or isinstance(g, Tree) else Tree.chain(g) for g in guesses]
        message = Verify(self._id, _views(rows), trees)
        return self._pipeline.run(message, lambda: super(PipelinedRunner, self).verify(rows, trees))

    def decode(self, rows) -> torch.Tensor:
        message = Decode(self._id, _views(rows))
        return self._pipeline.run(message, lambda: super(PipelinedRunner, self).decode(rows))

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


def _mixed(out):
    if out is None:  # (no compiled step on a stage: a mixed forward always runs)
        raise PipelineError("a mixed forward could not run on rank 0's stage")
    return out
