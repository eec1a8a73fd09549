"""Data parallel (`offload serve --data-parallel-size N`, vLLM's flag): N engine replicas,
each a whole `offload serve` process with its own model and offloading, behind one
OpenAI server that sends each request to the replica with the fewest in flight.

Each replica listens on loopback at a port the system picks (read from its start line)
and gets its own share of this machine's cores (its affinity, as `taskset` would set it,
and as many threads): replicas then compute side by side instead of on each other's
cores. A replica that stops fails the requests it was answering (an error naming it);
the server stays up on the others and `/health` says how many serve. `/metrics` gives
every replica's series labelled `replica="i"`, and their sums without the label.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from offload.errors import OffloadError
from offload.memory.threads import available_cores

_START = re.compile(r"^offload serve: .* on (http://[^\s/]+)/v1 ")
START_TIMEOUT_S = 1800.0  # a replica's load (a large model from a cold disk)


@dataclass
class Replica:
    """One engine process and what the front knows of it."""

    index: int
    process: subprocess.Popen
    url: str = ""
    in_flight: int = 0
    lines: list[str] = field(default_factory=list)  # its last stderr lines

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def ended(self) -> str:
        """One line: how it ended (or that it does not answer)."""
        if self.alive:
            return f"replica {self.index} does not answer"
        last = self.lines[-1] if self.lines and self.lines[-1].startswith("offload:") else ""
        return f"replica {self.index} stopped (exit status {self.process.returncode}){last and ': '}{last}"


class Replicas:
    """The replicas, started from `offload serve`'s own arguments (`argv`, less the flags
    the front owns), and the choice of one for each request."""

    def __init__(self, argv: list[str], count: int):
        self._lock = threading.Lock()
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        share = max(1, (len(cores) or available_cores()) // count)
        self.replicas = []
        for index in range(count):
            mine = cores[index * share : (index + 1) * share] if len(cores) >= count else cores
            self.replicas.append(_start(index, argv, mine, share))
        try:
            for replica in self.replicas:
                _wait_started(replica)
        except BaseException:
            self.stop()
            raise

    def pick(self, avoid: set[int] = frozenset()) -> Replica:  # type: ignore[assignment]
        """The living replica with the fewest requests in flight (counted as taken), but
        those `avoid` names (that could not be reached)."""
        with self._lock:
            living = [r for r in self.replicas if r.alive and r.index not in avoid]
            if not living:
                raise OffloadError(
                    "no replica answers: " + "; ".join(r.ended() for r in self.replicas)
                )
            replica = min(living, key=lambda r: (r.in_flight, r.index))
            replica.in_flight += 1
            return replica

    def done(self, replica: Replica) -> None:
        with self._lock:
            replica.in_flight -= 1

    def stop(self, wait_s: float = 30.0) -> None:
        """SIGTERM to every replica (each ends its requests and exits), then waited for."""
        for replica in self.replicas:
            if replica.alive:
                replica.process.terminate()
        deadline = time.monotonic() + wait_s
        for replica in self.replicas:
            try:
                replica.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                replica.process.kill()
                replica.process.wait()


def replica_argv(argv: list[str]) -> list[str]:
    """`offload serve`'s arguments for a replica: the front's own (its address, the
    replicas' count) taken out, loopback and a port the system picks put in."""
    owned = {"--host", "--port", "--data-parallel-size", "-dp"}
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in owned:
            skip = "=" not in arg
            continue
        kept.append(arg)
    return [*kept, "--host", "127.0.0.1", "--port", "0"]


def _start(index: int, argv: list[str], cores: list[int], threads: int) -> Replica:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}

    def pin() -> None:  # (in the child, before it runs: as `taskset -c CORES`)
        if cores:
            os.sched_setaffinity(0, cores)

    command = [sys.executable, "-m", "offload.cli", *replica_argv(argv)]
    process = subprocess.Popen(
        command, env=env, stderr=subprocess.PIPE, text=True, preexec_fn=pin,
        start_new_session=True,  # (Ctrl-C reaches the front, which stops the replicas)
    )  # fmt: skip
    return Replica(index, process)


def _wait_started(replica: Replica) -> None:
    """Until `replica`'s start line (its URL); its stderr then goes on to this process's,
    each line marked with its index (read in a thread of its own)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    stream = replica.process.stderr
    assert stream is not None
    for line in stream:
        line = line.rstrip("\n")
        replica.lines = [*replica.lines[-20:], line]
        started = _START.match(line)
        print(f"replica {replica.index}: {line}", file=sys.stderr, flush=True)
        if started:
            replica.url = started[1]
            threading.Thread(target=_forward, args=(replica,), daemon=True).start()
            return
        if time.monotonic() > deadline:
            break
    replica.process.wait(timeout=30)
    last = replica.lines[-1] if replica.lines else ""
    reason = last.removeprefix("offload: error: ") if last.startswith("offload:") else ""
    reason = reason or f"exit status {replica.process.returncode}"
    raise OffloadError(f"offload serve: replica {replica.index} did not start: {reason}")


def _forward(replica: Replica) -> None:
    stream = replica.process.stderr
    assert stream is not None
    for line in stream:
        line = line.rstrip("\n")
        replica.lines = [*replica.lines[-20:], line]
        print(f"replica {replica.index}: {line}", file=sys.stderr, flush=True)
