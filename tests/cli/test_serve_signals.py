"""Ctrl-C or SIGTERM while `offload serve` loads its model: one line and status 0, as once
it serves (it was status 130, and SIGTERM killed it without a word)."""

import os
import signal
import subprocess
import sys
import time

import pytest
from http_server import free_port


def _loading(process: subprocess.Popen, folder) -> bool:
    """Whether the process holds a file of the model's folder open or mapped: it loads."""
    root = f"/proc/{process.pid}"
    try:
        opened = [os.readlink(f"{root}/fd/{fd}") for fd in os.listdir(f"{root}/fd")]
        with open(f"{root}/maps") as maps:
            opened.append(maps.read())
    except OSError:  # (a descriptor closed meanwhile)
        return False
    return any(str(folder) in path for path in opened)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_loading_is_one_line_and_status_0(smollm2_path, sig):
    command = [sys.executable, "-m", "offload.cli", "serve", str(smollm2_path), "--port",
               str(free_port()), "--no-progress", "--enforce-eager"]  # fmt: skip
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not _loading(process, smollm2_path):
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
        time.sleep(0.005)
    process.send_signal(sig)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    assert err.splitlines()[-1] == f"offload serve: stopped by {sig.name}", err
    assert "Traceback" not in err
