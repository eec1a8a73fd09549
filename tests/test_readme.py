"""The README runs as written: every shell command and every Python block, each a fresh
process with exit status 0. The only substitutions are its two placeholders for a model
of your own (`MODEL`, `path/to/model`), which become the default model's folder."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PLACEHOLDERS = (r"\bMODEL\b", r"path/to/model")


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.M | re.S)


SERVED = "localhost:8000"  # the serving example: run together by its own test


def commands() -> list[str]:
    """Each shell line of the README, its comment cut off (not the serving example's)."""
    lines = [
        line.split("  #")[0].strip() for block in code_blocks("bash") for line in block.splitlines()
    ]
    return [line for line in lines if line and not line.startswith("#") and not _serves(line)]


def _serves(line: str) -> bool:
    return line.startswith("offload serve") or SERVED in line


def python_blocks() -> list[str]:
    return [block for block in code_blocks("python") if SERVED not in block]


def _runnable(command: str) -> str | None:
    """What this test runs of a README line: the set-up script is CI's own first step and
    the test command is this very run, so a line `scripts/setup.sh && X` runs X, and the
    test command itself is checked by CI."""
    command = command.removeprefix("scripts/setup.sh && ")
    if "pytest" in command:
        return None
    return command.replace(".venv/bin/", "")


def _environment(model: Path) -> dict[str, str]:
    env = dict(os.environ)
    # `offload` and `pip` are this environment's, as they are after `scripts/setup.sh`.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["HF_HUB_OFFLINE"] = "1"  # nothing here may need the network
    env["OMP_WAIT_POLICY"] = env.get("OMP_WAIT_POLICY", "PASSIVE")  # the test's neighbours
    return env


def _substitute(text: str, model: Path) -> str:
    for placeholder in PLACEHOLDERS:
        text = re.sub(placeholder, str(model), text)
    return text


def _run(args: list[str], model: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, cwd=ROOT, env=_environment(model), capture_output=True, text=True, timeout=600
    )


def test_the_first_block_is_the_setup_and_then_ci_s_test_command():
    first = code_blocks("bash")[0].splitlines()
    assert first[0].startswith("scripts/setup.sh && .venv/bin/offload generate")
    assert first[1].startswith("scripts/setup.sh && .venv/bin/python -m pytest")
    assert os.access(ROOT / "scripts" / "setup.sh", os.X_OK)


def test_the_readme_has_commands_and_python_blocks():
    assert len(commands()) >= 6 and len(python_blocks()) >= 2


def _distinct_runnable() -> list[str]:
    """Each README line this test runs, once: a line repeated (the set-up line's
    `offload generate` is shown again where the CLI is explained) is run once."""
    runnable: dict[str, str] = {}
    for command in commands():
        if _runnable(command):
            runnable.setdefault(_runnable(command), command)
    return list(runnable.values())


@pytest.mark.parametrize("command", _distinct_runnable())
def test_each_command_runs_as_written(command, smollm2_path):
    if command.startswith("pip ") and sys.prefix == sys.base_prefix:
        pytest.skip("pip would install into the system Python; this runs only in a venv")
    result = _run(["bash", "-c", _substitute(_runnable(command), smollm2_path)], smollm2_path)
    assert result.returncode == 0, result.stderr[-2000:]
    if command.endswith("offload generate"):  # the first thing a user runs
        assert "The capital of France is Paris." in result.stdout


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_each_python_block_runs_as_written(index, smollm2_path, tmp_path):
    script = tmp_path / f"block{index}.py"
    script.write_text(_substitute(python_blocks()[index], smollm2_path))
    result = _run([sys.executable, str(script)], smollm2_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip()  # every block prints what it shows


def test_the_serving_example_runs_as_written(smollm2_path, tmp_path):
    """`offload serve` started as the README starts it, then its curl line and its
    `openai` block against it, then SIGTERM: exit 0."""
    lines = [
        line.split("  #")[0].strip() for block in code_blocks("bash") for line in block.splitlines()
    ]
    serve = next(line for line in lines if line.startswith("offload serve"))
    curl = next(line for line in lines if line.startswith("curl") and SERVED in line)
    (block,) = [block for block in code_blocks("python") if SERVED in block]
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        ["bash", "-c", "exec " + serve.removesuffix("&").strip()],
        cwd=ROOT, env=_environment(smollm2_path), stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        _wait_until_serving(server, tmp_path / "serve.log")
        answer = _run(["bash", "-c", curl], smollm2_path)
        assert answer.returncode == 0 and "Paris" in answer.stdout, answer.stdout
        script = tmp_path / "client.py"
        script.write_text(block)
        result = _run([sys.executable, str(script)], smollm2_path)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip()
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=30)
    assert code == 0, (tmp_path / "serve.log").read_text()[-2000:]


def _wait_until_serving(server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(log.read_text()[-2000:])
        try:
            with urllib.request.urlopen(f"http://{SERVED}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise AssertionError("offload serve did not start: " + log.read_text()[-2000:])
