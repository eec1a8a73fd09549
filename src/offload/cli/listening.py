"""What `offload serve` and its data-parallel front share: the listening socket, taken
before anything loads, and SIGINT/SIGTERM handled in the main thread."""

from __future__ import annotations

import contextlib
import signal
import socket

from offload.errors import OffloadError


@contextlib.contextmanager
def listening(host: str, port: int):
    """A socket bound to (host, port) for the HTTP server, closed at the end."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # (uvicorn's own choice)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn's own)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise OffloadError(f"offload serve could not listen on {host}:{port}") from None
    with sock:
        yield sock


@contextlib.contextmanager
def on_signals(stop):
    """`stop(signum, frame)` handles SIGINT and SIGTERM inside the block."""
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
