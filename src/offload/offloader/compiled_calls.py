"""One compiled forward at a time through an offloader's shared slots.

A compiled graph bypasses the forward lock (torch.compile cannot trace it), so two
threads could interleave their layers on shared slots: refuse, never compute on another
layer's weights. Eager calls wait for each other instead (see `forward_lock.py`).
"""

from __future__ import annotations

import threading

from offload.errors import ModelError


class CompiledCalls:
    """Which thread is inside which offloaded layer of a compiled graph."""

    def __init__(self) -> None:
        self._running: dict[int, int] = {}  # thread -> the layer it is inside
        self._lock = threading.Lock()

    def claim(self, position: int) -> None:
        """This thread's compiled graph enters layer `position`."""
        me = threading.get_ident()
        with self._lock:
            self._check_alone(me)
            self._running[me] = position

    def release(self) -> None:
        """This thread's compiled graph leaves its layer."""
        me = threading.get_ident()
        with self._lock:
            self._running.pop(me, None)
            self._check_alone(me)  # before a refill that another layer may need

    def _check_alone(self, me: int) -> None:
        others = [t for t in self._running if t != me]
        if others and {t.ident for t in threading.enumerate()} & set(others):
            raise ModelError(
                "a torch.compile'd offloaded model was called from two threads at once; its "
                "layers share device slots: serialize the calls (a threading.Lock around the "
                "compiled model), or call the model uncompiled, whose calls wait for each other"
            )
