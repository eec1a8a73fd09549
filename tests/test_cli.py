import subprocess
import sys

import pytest

from offload.cli import main


def _run(*argv):
    return subprocess.run(
        [sys.executable, "-m", "offload.cli", *argv], capture_output=True, text=True, timeout=300
    )


def test_demo_answers_and_reports_what_moved(capsys, smollm2_path):
    assert main(["demo", "--max-tokens", "10", "--cpu-offload-gb", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "A: The capital of France is Paris." in out
    assert "tokens identical to the resident model: yes" in out
    assert "offloaded " in out and "model.layers.0.self_attn.q_proj.weight" in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["demo", "--cpu-offload-gb", "-1"], "uva.cpu_offload_gb must be a finite number >= 0"),
        (["demo", "--offload-backend", "disk"], "invalid choice: 'disk'"),
        (["demo", "--model", "/nonexistent/model"], "is not a model directory"),
        (["demo", "--max-tokens", "0"], "--max-tokens must be >= 1"),
        (
            ["demo", "--cpu-offload-params", "experts", "--cpu-offload-gb", "1"],
            "match no parameter",
        ),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, needle, smollm2_path):
    result = _run(*argv)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr
    assert lines[-1].startswith("offload: error: ") and needle in lines[-1]
