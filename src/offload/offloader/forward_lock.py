"""One forward at a time through an offloaded model, whichever threads call it.

Offloaded layers share device slots, and the slot table assumes one forward walks the
layers at a time: two threads interleaving their layers would each refill slots the
other still reads (silently wrong outputs, measured before this lock existed). So a
model's forwards are serialized: `ForwardLockHooks` take the lock before the root
module's forward and give it back after it.

A Ctrl-C (or any BaseException) skips torch's post-forward hooks, which would leave the
lock held for good and hang the next caller. So the lock remembers the frame of the
forward that holds it, and a holder whose frame is no longer on its thread's stack (or
whose thread has ended) has abandoned it: the next caller takes the lock over, after
the offloader has dropped whatever the abandoned forward left in flight (`recover`).
A forward that calls the root module again from inside itself (the same frame still on
the stack) is nested, and runs on.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Callable
from types import FrameType

import torch
from torch import nn

from offload.memory.threads import check_not_forked
from offload.offloader.hooks import AroundForward

_POLL_S = 0.05  # how often a waiting caller looks whether the holder abandoned the lock


class ForwardLock:
    """A re-entrant lock whose holder is a forward (a frame), not only a thread."""

    def __init__(self, on_abandoned: Callable[[], None]):
        self._condition = threading.Condition(threading.Lock())
        # (thread id, frame of the holding call, depth), replaced whole, never in parts
        self._holder: tuple[int, FrameType, int] | None = None
        # Weakly: the offloader owns this lock, and must not be kept alive by it.
        self._on_abandoned = weakref.WeakMethod(on_abandoned)
        self._pid = os.getpid()

    def acquire(self, frame: FrameType) -> bool:
        """Take the lock for the forward running in `frame` (waits while another live
        forward holds it); True unless the forward is nested in one that holds it."""
        check_not_forked(self._pid, "this offloaded model")
        me = threading.get_ident()
        with self._condition:
            while self._holder is not None:
                thread, held_frame, depth = self._holder
                if _is_running(thread, held_frame):
                    if thread == me:  # the root module called from inside its own forward
                        self._holder = (thread, held_frame, depth + 1)
                        return False
                    self._condition.wait(_POLL_S)
                    continue
                self._holder = None  # abandoned by a Ctrl-C or an ended thread
                recover = self._on_abandoned()
                if recover is not None:
                    recover()
            self._holder = (me, frame, 1)
            return True

    def release(self) -> None:
        with self._condition:
            if self._holder is None or self._holder[0] != threading.get_ident():
                return  # taken over after this forward was abandoned
            thread, frame, depth = self._holder
            self._holder = None if depth == 1 else (thread, frame, depth - 1)
            self._condition.notify_all()

    @property
    def is_outermost(self) -> bool:
        """Whether the calling thread holds the lock once (not nested)."""
        holder = self._holder
        return holder is not None and holder[0] == threading.get_ident() and holder[2] == 1

    @property
    def is_held(self) -> bool:
        return self._holder is not None


def _is_running(thread: int, frame: FrameType) -> bool:
    """Whether `frame` is still on the stack of `thread` (False once the thread ended)."""
    current = sys._getframe() if thread == threading.get_ident() else None
    if current is None:
        current = sys._current_frames().get(thread)
    while current is not None:
        if current is frame:
            return True
        current = current.f_back
    return False


class ForwardLockHooks(AroundForward):
    """Serialize the forwards of `module` (the root of an offloaded model) on `lock`, and
    call `on_start` / `on_end` around each outermost one, under the lock. Under
    torch.compile they trace to nothing: compiled callers serialize themselves."""

    def __init__(
        self,
        lock: ForwardLock,
        on_start: Callable[[], None] | None = None,
        on_end: Callable[[], None] | None = None,
    ):
        self._lock = lock
        # Weakly, as the lock holds its offloader: the hooks must not keep it alive.
        self._on_start = weakref.WeakMethod(on_start) if on_start else None
        self._on_end = weakref.WeakMethod(on_end) if on_end else None
        self._handles = []

    def _pre_forward(self, module: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling():
            return
        # The frame of torch's module call: on the stack for as long as this forward runs.
        if self._lock.acquire(sys._getframe(1)):
            _call(self._on_start)

    def _post_forward(self, module: nn.Module, args: tuple, output: object) -> None:
        if torch.compiler.is_compiling():
            return
        try:
            if self._lock.is_outermost:
                _call(self._on_end)
        finally:
            self._lock.release()


def _call(method: weakref.WeakMethod | None) -> None:
    function = method() if method is not None else None
    if function is not None:
        function()
