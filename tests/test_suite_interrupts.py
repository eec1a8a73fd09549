"""Ctrl-C stops the test run even where CPython drops it (tests/interrupts.py)."""

import gc
import signal
import threading
import time

import interrupts
import pytest


def test_a_ctrl_c_dropped_in_a_gc_callback_is_raised_again():
    raised = []

    def callback(phase, info):  # as hypothesis's, which a Ctrl-C during a collection hits
        if phase == "stop" and not raised:
            raised.append(True)
            raise KeyboardInterrupt  # "ignored" by CPython

    gc.callbacks.append(callback)
    try:
        with pytest.raises(KeyboardInterrupt):  # at once, from the helper thread
            gc.collect()
            time.sleep(2)
    finally:
        gc.callbacks.remove(callback)
    assert raised
    with pytest.raises(KeyboardInterrupt):  # and at the end of the test's phase
        interrupts.raise_if_dropped()
    interrupts.raise_if_dropped()  # (once)


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
