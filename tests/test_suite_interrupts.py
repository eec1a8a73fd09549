"""Ctrl-C stops the test run even where CPython drops it (tests/interrupts.py)."""

import gc
import signal
import threading
import time

import interrupts
import pytest


def _drop_a_ctrl_c():
    """A KeyboardInterrupt raised in a gc callback, as in hypothesis's when a Ctrl-C comes
    during a collection: CPython drops it ("Exception ignored")."""
    raised = []

    def callback(phase, info):
        if phase == "stop" and not raised:
            raised.append(True)
            raise KeyboardInterrupt

    gc.callbacks.append(callback)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(callback)
    assert raised


@pytest.mark.usefixtures("ctrl_c_raises")
def test_a_ctrl_c_dropped_in_a_gc_callback_is_raised_again_at_once():
    with pytest.raises(KeyboardInterrupt):  # from the helper thread
        _drop_a_ctrl_c()
        time.sleep(2)
    interrupts.raise_if_dropped()  # once: not again at the end of the phase


def test_a_ctrl_c_dropped_is_raised_at_the_end_of_the_phase_if_that_comes_first():
    _drop_a_ctrl_c()
    with pytest.raises(KeyboardInterrupt):
        interrupts.raise_if_dropped()
    try:
        time.sleep(0.2)  # the helper's moment: it finds it raised already
    except KeyboardInterrupt:
        pytest.fail("raised twice")


@pytest.mark.usefixtures("ctrl_c_raises")
def test_a_ctrl_c_while_waiting_for_threads_stops_and_joins_them():
    threads = []

    def work(number, stop):
        threads.append(threading.current_thread())
        deadline = time.monotonic() + 5  # (ends by itself where the helper fails)
        while not stop.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)  # torch, in a test

    main = threading.main_thread().ident
    threading.Timer(0.2, signal.pthread_kill, (main, signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        interrupts.run_in_threads(work, 2)
    assert len(threads) == 2 and not any(thread.is_alive() for thread in threads)
