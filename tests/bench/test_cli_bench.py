"""`offload bench` on the command line: bad input is one line on stderr and exit 2, a
good run writes the table, the JSON and (with matplotlib) the PNG."""

import json
import subprocess
import sys

import pytest

from offload.cli import main


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--methods", "frobnicate"], "argument --methods: invalid choice: 'frobnicate'"),
        (["--batch-sizes", "0"], "batch_sizes (--batch-sizes) must be one or more integers >= 1"),
        (["--batch-sizes", "x"], "argument --batch-sizes: invalid int value: 'x'"),
        (["--model", "llama-9"], "must be a model folder or a shipped shape (llama-3-70b"),
        (["--output-len", "1"], "output_len (--output-len) must be an integer >= 2, got 1"),
        (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (
            ["-q", "bitsandbytes"],
            "quantization (--quantization)='bitsandbytes' is not supported (yet; read: gguf, ",
        ),
        (["--device", "tpu"], "device must be 'cpu', 'cuda' or 'cuda:N'"),
        (
            ["--prompt-len", "100000000", "--model", "llama-3-8b"],
            "must be at most the model's 8192 positions, got 100000000 + 8",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, needle, capsys):
    try:
        status = main(["bench", *argv])
    except SystemExit as exit:  # argparse's own errors
        status = exit.code
    err = capsys.readouterr().err
    assert status == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("offload: error: ") and needle in lines[0]


def test_a_bad_model_in_a_fresh_process_has_no_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "offload.cli", "bench", "--model", "llama-9"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("offload: error: model (--model)")


def test_a_run_writes_the_table_json_and_png(tiny_llama_path, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    argv = ["bench", "--model", str(tiny_llama_path), "--device", "cpu", "--batch-sizes", "1"]
    argv += ["--output-len", "2", "--rounds", "1", "--methods", "resident", "prefetch-half"]
    assert main([*argv, "--out", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "prefetch-half" in out and "x best" in out
    assert all(len(line) <= 100 for line in out.splitlines() if not line.startswith("saved "))
    [json_path] = tmp_path.glob("bench-cpu-*.json")
    assert json.loads(json_path.read_text())["workload"]["batch_sizes"] == [1]
    png = json_path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"saved {png}" in out
