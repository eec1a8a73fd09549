"""A program's end without CPython's finalization: the exit handlers run, the other
threads are waited for and the streams flushed as at a normal exit, then the process ends
at once. Finalizing a process that has built a model (freeing every module's objects,
torch's and transformers' among them) took 0.6-0.67 s of each `offload generate` and each
pipeline rank here, against 0.03-0.04 s so (docs/benchmarks.md); what a process holds (its
memory, files, sockets) the system takes back either way."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading


def leave_now(status: int) -> None:
    """End the process with `status`, as a normal exit would but without finalizing it."""
    # What a normal exit does first: the thread pools told to end, the other non-daemon
    # threads waited for (CPython's own step, private but there since 3.4).
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(status)
