"""Ctrl-C stops the test run even where CPython drops it (tests/interrupts.py)."""

import gc
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
