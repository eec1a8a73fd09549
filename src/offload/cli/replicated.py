"""`offload serve --data-parallel-size N`: N replicas (`server/replicas.py`), each an
`offload serve` of the same arguments on loopback, behind one server at --host/--port
(`server/front.py`). SIGINT and SIGTERM stop the front, then the replicas (each ends its
requests); exit 0."""

from __future__ import annotations

import argparse
import sys
import threading

import uvicorn

from offload.cli.listening import listening, on_signals
from offload.cli.options import package_version
from offload.config.validate import integer
from offload.server.front import front_app
from offload.server.replicas import Replicas


def serve_replicas(args: argparse.Namespace) -> int:
    integer("--port", args.port, 0, 65535, what="in [0, 65535]")
    # (the port taken first, as one server's: busy, it is an error before any load)
    with listening(args.host, args.port) as sock:
        replicas = Replicas(args.argv, args.data_parallel_size)
        try:
            app = front_app(replicas, package_version())
            config = uvicorn.Config(
                app, log_level="warning", access_log=False, timeout_graceful_shutdown=3
            )
            server = uvicorn.Server(config)
            port = sock.getsockname()[1]
            name = args.served_model_name or args.model_tag or args.model or "the default model"
            print(
                f"offload serve: {name} on http://{args.host}:{port}/v1 "
                f"({len(replicas.replicas)} replicas: "
                + ", ".join(r.url for r in replicas.replicas)
                + ")",
                file=sys.stderr,
                flush=True,
            )
            # (off the main thread uvicorn leaves the signals alone: they stop it here,
            # and the replicas after it)
            http = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
            with on_signals(lambda signum, frame: setattr(server, "should_exit", True)):
                http.start()
                while http.is_alive():
                    http.join(timeout=0.5)
        finally:
            replicas.stop()
    return 0
