"""The `offload` command. Errors are one line on stderr and a non-zero exit."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import sys
import time
import warnings
from collections.abc import Sequence

from offload.cli.parser import build_parser, one_line_warning
from offload.config import OffloadConfig
from offload.config.validate import integer
from offload.errors import OffloadError

__all__ = ["build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """The command. As the program (`argv` None: sys.argv's), Ctrl-C is one line and status
    130; called from Python with `argv`, a KeyboardInterrupt goes on to the caller, whose
    Ctrl-C it is (as a status it was lost: a test run went on after it)."""
    status = _command(argv)
    if argv is None:
        _leave_compiles(status)
        from offload.llm.process_exit import leave_now

        leave_now(status)  # (finalizing would take 0.6 s more: `process_exit`)
    return status


def _leave_compiles(status: int) -> None:
    """End the program now where a decode step still compiles in the background (a
    server stopped by SIGTERM before its compile finished): CPython ends a daemon thread
    that is inside torch's C++ at exit by aborting the process (status 134, "terminate
    called without an active exception": 1 of 4 such stops in benchmarks/scale.py). The
    exit handlers run first; the unfinished step keeps nothing (`step_cache.save` writes
    whole files only)."""
    jobs = sys.modules.get("offload.engine.step_jobs")  # (imported only where steps compile)
    if jobs is None or not jobs.busy():
        return
    atexit.unregister(jobs.finish_at_exit)  # (it would wait for the compile)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(status)


def _command(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # (data parallel's replicas)
    if argv is None:  # the program: a user reads the warning, not our source line
        warnings.formatwarning = one_line_warning
    try:
        if args.command == "demo":
            return _demo(args)
        if args.command == "serve":
            from offload.cli.serve import run_serve

            return run_serve(args)
        from offload.cli import commands as run

        if args.command == "generate":
            run.generate(args)
        elif args.command == "bench":
            run.bench(args)
        elif args.command == "plan":
            from offload.cli.plan import run_plan

            print(run_plan(args, parser._commands()["generate"]._option_string_actions))
        else:
            print(run.inspect(args))
        sys.stdout.flush()  # a closed pipe (`| head -1`) is met here, not at exit
        return 0
    except BrokenPipeError:
        # The reader has gone (`offload plan | head -1`): quiet, as a shell's own tools
        # are, with the status of a SIGPIPE; stdout to /dev/null so exit's flush is too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OffloadError as error:
        print(f"offload: error: {error}", file=sys.stderr)
    except OSError as error:  # unreadable files, a tokenizer missing from the model folder
        print(f"offload: error: {error.strerror or error}", file=sys.stderr)
    except KeyboardInterrupt:
        if argv is not None:
            raise
        print("offload: interrupted", file=sys.stderr)
        return 130  # the shell's status for SIGINT
    return 2


def _demo(args: argparse.Namespace) -> int:
    from offload.cli.demo import run_demo

    integer("--max-tokens", args.max_tokens, 1, what=">= 1")
    from offload.memory.device import check_device

    config = OffloadConfig.from_cli_args(args)
    started = time.perf_counter()
    device = check_device(args.device)
    report = run_demo(args.model, args.prompt, args.max_tokens, device, config)
    print(report)
    print(f"({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":  # python -m offload.cli.main
    sys.exit(main())
