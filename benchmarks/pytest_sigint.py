"""Ctrl-C in the test suite: the quick subset interrupted with SIGINT at random moments
must exit as pytest does when interrupted (status 2), never with a native abort or a hang.

    python benchmarks/pytest_sigint.py [--moments 5] [--seed 0] [--earliest 2] [--latest 60]

Each moment starts `pytest -m "not slow" -q` (the README test deselected) in its own
process group, sends SIGINT to the whole group after a seeded random delay, as a terminal's
Ctrl-C does, and waits `--timeout` s for it to exit. The spread covers start-up (imports,
collection) and test bodies with threads, compiles and subprocesses. Recorded per moment:
the exit status, the seconds from the signal to the exit, where the interrupt landed (and
the output's last lines), and processes of the group left running after pytest exited.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common

ROOT = Path(__file__).resolve().parent.parent
PYTEST = ["-m", "pytest", "-m", "not slow", "-q", "-p", "no:cacheprovider",
          "--deselect", "tests/test_readme.py"]  # fmt: skip
INTERRUPTED = 2  # pytest's exit status for KeyboardInterrupt
CLEAN = ("interrupted", "finished")  # (finished: the run ended before its moment)
# What a native abort leaves in the output: C++'s std::terminate, abort(), CPython's fatal error.
ABORT_MARKS = ("terminate called", "Aborted", "Fatal Python error", "core dumped")
_PROGRESS = re.compile(r"^[.sFExX]+( +\[ *\d+%\])?$")  # a line of -q's test outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--moments", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--earliest", type=float, default=2.0, help="s after the start")
    parser.add_argument("--latest", type=float, default=60.0, help="s after the start")
    parser.add_argument("--timeout", type=float, default=60.0, help="s to exit after SIGINT")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    delays = [round(rng.uniform(args.earliest, args.latest), 2) for _ in range(args.moments)]
    print(f"{' '.join(PYTEST[1:])}: SIGINT to the group at {delays} s (seed {args.seed})")
    results = []
    for number, delay in enumerate(delays, 1):
        result = interrupt_at(delay, args.timeout)
        results.append(result)
        print(f"  {number}: at {delay:5.1f} s -> {result['outcome']:<12} exit {result['exit_code']}"
              f", {result['exit_after_s']} s after SIGINT, in {result['where']}"
              + (f"; left running: {result['left_running']}" if result["left_running"] else ""))  # fmt: skip
        if result["outcome"] not in CLEAN:
            print("     " + "\n     ".join(result["processes_when_hung"] + result["tail"][-15:]))
    failed = [r for r in results if r["outcome"] not in CLEAN]
    print(f"{len(results) - len(failed)} of {len(results)} exited cleanly")
    payload = {"command": PYTEST, "seed": args.seed, "delays_s": delays,
               "timeout_s": args.timeout, "results": results, "clean": len(results) - len(failed)}  # fmt: skip
    print(f"saved {common.save('pytest-sigint', torch.device('cpu'), payload)}")
    sys.exit(1 if failed else 0)


def interrupt_at(delay_s: float, timeout_s: float) -> dict[str, object]:
    """One run of the quick subset, SIGINT to its process group `delay_s` after the start."""
    with tempfile.TemporaryFile(mode="w+") as log:
        process = subprocess.Popen(
            [sys.executable, *PYTEST], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_no_core_files,
        )  # fmt: skip
        group = process.pid  # (a new session: its own group, led by pytest)
        signalled = None
        if _running_after(process, delay_s):
            os.killpg(group, signal.SIGINT)
            signalled = time.perf_counter()
        hung, processes, second = False, [], None
        if _running_after(process, timeout_s):
            # Ignored: what runs now, then Ctrl-C again (pytest's summary then names the
            # test that took the first one), else every thread's stack (pytest's
            # faulthandler on SIGABRT).
            hung, processes = True, _descendants(process.pid)
            os.killpg(group, signal.SIGINT)
            if _running_after(process, timeout_s):
                process.send_signal(signal.SIGABRT)
                time.sleep(2)
            else:
                second = process.returncode
        left = _group_members(group)
        for pid in [*left, group] if process.poll() is None else left:
            with contextlib.suppress(ProcessLookupError):  # (it ended meanwhile)
                os.kill(pid, signal.SIGKILL)
        process.wait()
        exit_after = None if signalled is None or hung else time.perf_counter() - signalled
        log.seek(0)
        output = log.read()
    outcome = _outcome(process.returncode, output, hung, signalled is not None)
    plain = outcome == "finished" or process.returncode == INTERRUPTED  # (short output kept)
    return {
        "delay_s": delay_s,
        "signalled": signalled is not None,
        "outcome": outcome,
        "exit_code": process.returncode,
        "exit_after_s": None if exit_after is None else round(exit_after, 2),
        "where": _where(output),
        "left_running": left,
        "processes_when_hung": processes,
        "exit_code_after_second_sigint": second,
        # The whole output where anything was not plain (a hang's stacks), else its end.
        "tail": output.rstrip().splitlines()[-15 if plain else -600 :],
    }


def _running_after(process: subprocess.Popen, seconds: float) -> bool:
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return True
    return False


def _outcome(code: int, output: str, hung: bool, signalled: bool) -> str:
    if hung:
        return "hang"
    if code in (134, -signal.SIGABRT) or any(mark in output for mark in ABORT_MARKS):
        return "native-abort"
    if not signalled:
        return "finished"
    if code == INTERRUPTED:
        return "interrupted"
    # Before pytest's session catches it (imports, plugins), Python itself exits by SIGINT.
    if code in (-signal.SIGINT, 130) and "KeyboardInterrupt" in output:
        return "interrupted"
    return "unexpected"


def _where(output: str) -> str:
    """Where the interrupt landed (pytest's "file:line: KeyboardInterrupt"), and how far
    the run had come (its last progress figure)."""
    found = re.findall(r"^(.+:\d+): KeyboardInterrupt$", output, re.MULTILINE)
    done = sum(len(line.split()[0]) for line in output.splitlines() if _PROGRESS.match(line))
    place = found[-1].replace(str(ROOT) + "/", "").split("site-packages/")[-1] if found else "?"
    return f"{place} ({done} tests done)"


def _group_members(group: int) -> list[int]:
    """The processes still running in process group `group` (a test's server...)."""
    return [pid for pid, (_, pgid, state, _) in _processes().items()
            if pgid == group and state != "Z" and pid != group]  # fmt: skip


def _descendants(root: int) -> list[str]:
    """`root`'s processes, children and theirs: "pid ppid pgid state command" each."""
    table = _processes()
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        found.append(parent)
        frontier += [pid for pid, (ppid, *_) in table.items() if ppid == parent]
    return [f"{pid} {' '.join(map(str, table[pid]))}" for pid in found if pid in table]


def _processes() -> dict[int, tuple[int, int, str, str]]:
    """Every process: pid -> (parent, group, state, command line) from /proc."""
    table = {}
    for folder in Path("/proc").glob("[0-9]*"):
        try:
            fields = (folder / "stat").read_text().rsplit(")", 1)[1].split()
            command = (folder / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except OSError:  # (it exited meanwhile)
            continue
        table[int(folder.name)] = (int(fields[1]), int(fields[2]), fields[0], command)
    return table


def _no_core_files() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


if __name__ == "__main__":
    main()
