"""How `scale.py` runs each measurement in a fresh process: the page cache set cold or
warm first, a watch on the process's RSS (killed above a cap, so that a library that
blows its budget cannot take the shared machine down: that is recorded as a finding),
`scale_child.py` for `offload.LLM` and accelerate, and `offload serve` with `serve.py`'s
server and clients at 1 and more concurrent clients."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import common
import serve  # benchmarks/serve.py: its server, clients and figures

CHILD = Path(__file__).with_name("scale_child.py")
SERVED_NAME = serve.SERVED_NAME


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under `folder` (0 where it does not exist)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def set_pages(files: list[Path], cold: bool) -> int:
    """The files' pages dropped from the page cache (`posix_fadvise(POSIX_FADV_DONTNEED)`
    on each, not the machine-wide drop_caches: other programs run here) or read into it;
    the bytes of them cached afterwards (`mincore`)."""
    files = [f for f in files if f.is_file()]
    if cold:
        common.drop_file_cache(files)
    else:
        common.warm_file_cache(files)
    return common.cached_file_bytes(files)


def status_bytes(pid: int, key: str) -> int | None:
    """`key` (VmRSS, VmHWM) of process `pid` in bytes; None once it has gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0]) * 1024
    return None


class RssWatch:
    """Polls the RSS of the process `pid_of()` names, keeps its peak and kills it above
    `cap_bytes` (then `killed_at_bytes` says where)."""

    def __init__(self, pid_of: Callable[[], int | None], cap_bytes: int):
        self.pid_of, self.cap_bytes = pid_of, cap_bytes
        self.peak_bytes, self.killed_at_bytes = 0, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.25):
            pid = self.pid_of()
            rss = status_bytes(pid, "VmRSS") if pid else None
            if rss is None:
                continue
            self.peak_bytes = max(self.peak_bytes, rss)
            if rss > self.cap_bytes and self.killed_at_bytes is None:
                self.killed_at_bytes = rss
                os.kill(pid, 9)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        found = {"polled_peak_rss_bytes": self.peak_bytes}
        if self.killed_at_bytes is not None:
            found["error"] = f"killed: RSS {self.killed_at_bytes / 2**30:.2f} GiB passed the cap"
        return found


def run_child(spec: dict, env: dict[str, str], timeout_s: float, cap_bytes: int) -> dict:
    """`scale_child.py` with `spec` in a fresh process, `env` added to this one's
    environment; its result line (or why there is none)."""
    command = [sys.executable, str(CHILD), json.dumps(spec)]
    process = subprocess.Popen(
        command,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    watch = RssWatch(lambda: process.pid, cap_bytes)
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        err += f"\ntimed out after {timeout_s:.0f} s"
    found = watch.stop()
    lines = [line for line in out.splitlines() if line.startswith("SCALE-RESULT ")]
    result = json.loads(lines[-1].removeprefix("SCALE-RESULT ")) if lines else {}
    if not lines:
        tail = " | ".join(err.strip().splitlines()[-4:])
        result["error"] = found.get("error") or f"exit {process.returncode}: {tail}"
    result["polled_peak_rss_bytes"] = found["polled_peak_rss_bytes"]
    result["stderr_tail"] = err.strip().splitlines()[-6:]
    return result


def complete(url: str, prompt: str, max_tokens: int) -> str:
    """One greedy, unstreamed /v1/completions answer's text (its tokens set by `ignore_eos`)."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=serve.REQUEST_TIMEOUT_S) as response:
        return json.loads(response.read())["choices"][0]["text"]


def run_serve(model: str, flags: list[str], env: dict[str, str], args, log: Path) -> dict:
    """`offload serve MODEL FLAGS` as a user starts it (its default --max-num-seqs); after
    one warm-up answer (whose text is compared with `generate`'s), `args.rounds` runs of
    N streamed chats for each N of `args.clients` (serve.py's clients); the server's peak
    RSS (`VmHWM`, read just before SIGTERM) and its disk reads per forward (/metrics)."""
    port = serve.free_port()
    # Through `env`, which execs the server in its place: the pid watched is the server's.
    command = ["env", *(f"{k}={v}" for k, v in env.items()),
               sys.executable, "-m", "offload.cli", "serve", model, "--port", str(port),
               "--served-model-name", SERVED_NAME, "--no-progress", *flags]  # fmt: skip
    serve.HEALTH_TIMEOUT_S = args.timeout_s  # a first start compiles: minutes under load
    server = serve.Server(command, port, log)
    result: dict = {"command": command[command.index("serve") :]}
    watch = RssWatch(lambda: server.process.pid if server.process else None, args.cap_bytes)
    try:
        with serve.running(server):
            result["startup_s"], result["rows"] = server.startup_s, server.max_rows
            result["text"] = complete(server.url, args.prompt, args.max_tokens)
            began = time.monotonic()  # the steady state: no step left compiling behind it
            serve.steps_settled(server.url, args.timeout_s)
            result["settle_s"] = time.monotonic() - began
            result["clients"] = [_clients(server.url, n, args) for n in args.clients]
            result["peak_rss_bytes"] = status_bytes(server.process.pid, "VmHWM")
    except Exception as error:  # a server that fails at this size is a finding too
        result["error"] = f"{type(error).__name__}: {error}"
    finally:
        found = watch.stop()
    result["polled_peak_rss_bytes"] = found["polled_peak_rss_bytes"]
    result["error"] = found.get("error") or result.get("error")
    result["exit"] = server.exit
    result["stated_overhead_bytes"] = stated_overhead_bytes(log)
    return result


_OVERHEAD = re.compile(r"fixed overhead (\d+\.\d+) GiB")  # (serve's start line, on a budget)


def stated_overhead_bytes(log: Path) -> int | None:
    """The fixed overhead `offload serve` states on its start line (None: none stated)."""
    found = _OVERHEAD.search(log.read_text()) if log.is_file() else None
    return int(float(found.group(1)) * 2**30) if found else None


def _clients(url: str, n: int, args) -> dict:
    work = serve.Workload(SERVED_NAME, args.max_tokens, {"ignore_eos": True})
    rows = []
    for _ in range(args.rounds):
        before = serve.scrape(url)
        records, wall = serve.run_clients(url, work, n, 1)
        rows.append(serve.summarize(n, records, wall, before, serve.scrape(url)))
    return {"concurrency": n, "rounds": rows}
