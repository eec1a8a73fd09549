"""Ctrl-C ends a test run cleanly (benchmarks/pytest_sigint.py).

Even where CPython drops it: a KeyboardInterrupt raised inside a gc callback (hypothesis
times every collection with one) or a weakref finalizer goes to `sys.unraisablehook` as
"ignored", and the run went on. Here it is raised again in the main thread: at once from a
helper thread, and at the end of the test's phase at the latest (tests/conftest.py).

And with no thread of a test still running torch: at exit, CPython ends such a daemon
thread inside torch's C++ ("terminate called without an active exception", SIGABRT).
`run_in_threads` stops and joins a test's threads however its wait ends."""

from __future__ import annotations

import _thread
import signal
import sys
import threading
import time
from collections.abc import Callable

_dropped = False  # a KeyboardInterrupt was dropped and is not raised again yet
_lock = threading.Lock()  # it is raised again once: by the helper or at the phase's end


def install() -> None:
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        global _dropped
        if not issubclass(unraisable.exc_type, KeyboardInterrupt):
            previous(unraisable)
            return
        with _lock:
            _dropped = True
        # Not from here: raised inside this hook, it would be dropped again.
        _thread.start_new_thread(_interrupt_main_soon, ())

    sys.unraisablehook = hook


def _take() -> bool:
    global _dropped
    with _lock:
        dropped, _dropped = _dropped, False
    return dropped


def _interrupt_main_soon() -> None:
    time.sleep(0.05)  # the main thread is out of the callback by then (if not: dropped, again)
    if _take():  # (else raised at a phase's end already: a second one would cut its report)
        # A signal, as Ctrl-C's, to the main thread: it also ends a sleep or a wait there.
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def raise_if_dropped() -> None:
    if _take():
        raise KeyboardInterrupt


def run_in_threads(work: Callable[[int, threading.Event], None], num_threads: int) -> None:
    """`work(number, stop)` in `num_threads` threads, until each returns; if the wait ends
    otherwise (Ctrl-C), `stop` is set and they are joined first (`work` checks it)."""
    stop = threading.Event()
    threads = [threading.Thread(target=work, args=(n, stop)) for n in range(num_threads)]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join()
    finally:
        stop.set()
        for thread in threads:
            thread.join()


def cut_lineless_frames(error: BaseException | None) -> None:
    """End each traceback of `error`'s chain before its first frame with no line number.
    CPython 3.11 gives one to a KeyboardInterrupt raised at some instructions
    (cpython#107901: "line -1"), and pytest's report of it failed on `None - 1`: exit 1
    and an internal error instead of the interrupt's exit 2."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        entry = error.__traceback__
        while entry is not None and entry.tb_next is not None:
            if entry.tb_next.tb_lineno is None:
                entry.tb_next = None
            entry = entry.tb_next
        error = error.__cause__ or error.__context__
