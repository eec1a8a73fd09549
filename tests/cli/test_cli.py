import re
import subprocess
import sys

import pytest

from offload.cli import main
from offload.errors import ConfigError


def _in_process(argv, capsys):
    """`offload argv` in this process (no interpreter to start): its exit status and all it
    wrote on stderr."""
    capsys.readouterr()  # what the test itself wrote before is not the command's
    try:
        status = main(argv)
    except SystemExit as done:  # argparse's own errors
        status = done.code
    return status, capsys.readouterr().err


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
def test_bad_input_is_one_line_and_exit_2(argv, needle, smollm2_path, capsys):
    status, err = _in_process(argv, capsys)
    assert status == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err
    assert lines[-1].startswith("offload: error: ") and needle in lines[-1]


def test_in_a_fresh_process_bad_input_is_one_line_and_exit_2(smollm2_path):
    """The command as a shell runs it: its own imports and warnings, then one line."""
    for argv, needle in [
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["generate", "--swap-space", "1e6"], "swap_space=1e+06 GiB is not possible"),
    ]:
        result = _run(*argv)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert lines[-1].startswith("offload: error: ") and needle in lines[-1]


def test_a_reader_gone_is_quiet_with_sigpipes_status(smollm2_path):
    """`offload inspect | head -c 0`: the pipe closes before the answer is written; the
    command ends quietly with 141 (a shell's status for SIGPIPE), as a shell's tools do."""
    reader = subprocess.Popen(
        [sys.executable, "-m", "offload.cli", "inspect"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    reader.stdout.close()
    err = reader.stderr.read()
    assert reader.wait(timeout=300) == 141
    assert "Traceback" not in err and "error" not in err and "Exception ignored" not in err


def test_inspect_names_the_dtype_as_the_flags_do(capsys, smollm2_path):
    assert main(["inspect", "--dtype", "float32"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "(float32)" in first and "torch." not in first


def test_generate_with_no_arguments_answers(capsys, smollm2_path):
    assert main(["generate"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "The capital of France is Paris."
    assert "tok/s" in out[-1] and "UVAOffloader" in out[-1] and "moved" in out[-1]


def test_generate_prefetch_batch_and_stop(capsys, smollm2_path):
    argv = [
        "generate",
        "--prompt",
        "1, 2, 3,",
        "--prompt",
        "a, b, c,",
        "--stop",
        ", 6",
        "--offload-group-size",
        "2",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["--- prompt 1: 1, 2, 3,", " 4, 5"] and "PrefetchOffloader" in out[-1]
    assert out[2] == "--- prompt 2: a, b, c,"


def test_generate_passes_the_penalties_on(capsys, smollm2_path):
    from offload import LLM, SamplingParams

    flags = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.25}
    argv = ["generate", "--prompt", "1, 2, 3,", "--max-tokens", "12", "--no-progress"]
    for name, value in flags.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    assert main(argv) == 0
    text = capsys.readouterr().out.splitlines()[0]
    params = SamplingParams(temperature=0, max_tokens=12, **flags)
    [expected] = LLM(smollm2_path).generate("1, 2, 3,", params)
    assert text == expected.outputs[0].text.splitlines()[0]
    assert not text.startswith(" 4, 5, 6, 7")  # what greedy without penalties says


def test_generate_with_the_kv_cache_in_host_memory(capsys, smollm2_path):
    assert main(["generate", "--swap-space", "0.5", "--offload-group-size", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "The capital of France is Paris."
    kv = re.search(r"KV cache ([\d.]+) (KiB|MiB)\)", out[-1])
    assert kv and float(kv.group(1)) > 0, out[-1]


def test_inspect_reports_the_plan(capsys, smollm2_path):
    assert (
        main(
            [
                "inspect",
                str(smollm2_path),
                "--offload-group-size",
                "8",
                "--offload-num-in-group",
                "2",
                "--offload-prefetch-unit",
                "layer",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "model.layers: 30 x LlamaDecoderLayer" in out
    # 2 (K, V) x 30 layers x 3 KV heads x 64 dims x 4 bytes; 8192 positions.
    assert "KV cache: 45.0 KiB per position per sequence, 360.0 MiB for 8192 positions" in out
    assert (
        "prefetch would offload 81.0 MiB (54 parameters of 6 modules: model.layers.6, model.layers.7"
        in out
    )
    assert "device staging: 1 slot(s) of layer units, 13.5 MiB in all" in out


def test_inspect_on_a_small_cache_cpu_plans_module_units_by_default(
    capsys, smollm2_path, monkeypatch
):
    from offload.offloader import units

    monkeypatch.setattr(units, "last_level_cache_bytes", lambda: 32 * 2**20)
    monkeypatch.setattr(units, "available_cores", lambda: 99)  # a core free for a copy thread
    flags = ["--device", "cpu", "--offload-group-size", "1", "--offload-prefetch-step", "2"]
    assert main(["inspect", str(smollm2_path), *flags]) == 0
    out = capsys.readouterr().out
    # 3 x 13.5 MiB layers overflow 32 MiB: three modules ahead; the largest (gate, up,
    # down) are 576 x 1536 float32, 3.4 MiB.
    assert "device staging: 3 slot(s) of module units, 10.1 MiB in all" in out


def _damaged(tmp_path, smollm2_path, damage):
    import shutil

    target = tmp_path / "model"
    shutil.copytree(smollm2_path, target)
    damage(target)
    return str(target)


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (
            lambda p: (p / "model.safetensors").write_bytes(b"garbage!" * 4),
            "is not a valid safetensors file",
        ),
        (
            lambda p: (p / "config.json").write_text('{"model_type": "nope"}'),
            "unknown or unsupported architecture",
        ),
        (lambda p: (p / "model.safetensors").unlink(), "has no model.safetensors"),
    ],
)
def test_generate_bad_model_folders(tmp_path, smollm2_path, damage, needle, capsys):
    argv = ["generate", "--model", _damaged(tmp_path, smollm2_path, damage)]
    status, err = _in_process(argv, capsys)
    assert status == 2 and "Traceback" not in err
    assert needle in err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["generate", "--model", "/nonexistent"], "does not exist"),
        (["generate", "--temperature", "-1"], "temperature must be in"),
        (["generate", "--repetition-penalty", "0"], "repetition_penalty must be in (0.0, inf)"),
        (["generate", "--presence-penalty", "3"], "presence_penalty must be in [-2.0, 2.0]"),
        (["generate", "--frequency-penalty", "x"], "invalid float value: 'x'"),
        (["generate", "--min-p", "1.5"], "min_p must be in [0.0, 1.0]"),
        (["generate", "--dtype", "int4"], "invalid choice: 'int4'"),
        (["inspect", "/nonexistent"], "does not exist"),
        (
            ["generate", "--offload-group-size", "2", "--offload-num-in-group", "3"],
            "must be <= offload_group_size",
        ),
        (["generate", "--swap-space", "1e6"], "swap_space=1e+06 GiB is not possible"),
        (["generate", "--swap-space", "-2"], "swap_space=-2 GiB is not possible"),
        (["generate", "--swap-space", "lots"], "invalid float value: 'lots'"),
        (["generate", "--device", "nonsense"], "device must be 'cpu', 'cuda' or 'cuda:N'"),
        (["generate", "--device-memory-gb", "nan"], "device_memory_gb must be a positive"),
        (
            ["inspect", "llama-3-8b", "--device", "nonsense", "--cpu-offload-gb", "1"],
            "device must be 'cpu', 'cuda' or 'cuda:N'",
        ),
    ],
)
def test_generate_and_inspect_bad_input(argv, needle, capsys):
    status, err = _in_process(argv, capsys)
    assert status == 2 and "Traceback" not in err
    assert needle in err.strip().splitlines()[-1]


def test_generate_without_a_chat_template_asks_the_plain_question(smollm2_path, tmp_path, capsys):
    for item in smollm2_path.iterdir():
        if item.name != "chat_template.jinja":
            (tmp_path / item.name).symlink_to(item)
    argv = ["generate", "--model", str(tmp_path), "--max-tokens", "4", "--no-progress"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert "tokens in" in captured.out.splitlines()[-1]
    status, err = _in_process(["generate", "--model", str(tmp_path), "--chat"], capsys)
    assert status == 2 and "no chat template" in err.strip().splitlines()[-1]


def test_a_state_space_model_is_inspected_and_refused_by_generate_in_one_line(tmp_path, capsys):
    import zoo

    zoo.save_with_tokenizer(zoo.build("mamba"), tmp_path)
    assert main(["inspect", str(tmp_path), "--offload-group-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "KV cache: none" in out and "backbone.layers.1" in out
    status, err = _in_process(["generate", "--model", str(tmp_path), "--no-progress"], capsys)
    assert status == 2 and "Traceback" not in err
    assert "keeps a recurrent state" in err.strip().splitlines()[-1]


def _main(argv, capsys):
    """`offload argv` in this process: its exit status and the last line on stderr."""
    try:
        status = main(argv)
    except SystemExit as done:  # argparse's own errors
        status = done.code
    lines = capsys.readouterr().err.strip().splitlines()
    return status, lines[-1] if lines else ""


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["generate", "--temperature", "inf"], "temperature must be in [0.0, 2.0], got inf"),
        (["generate", "--temperature", "nan"], "temperature must be a number, got nan"),
        (["generate", "--top-p", "nan"], "top_p must be a number"),
        (["generate", "--max-tokens", "1e400"], "argument --max-tokens: invalid int value"),
        (["generate", "--seed", "x"], "argument --seed: invalid int value: 'x'"),
        (["generate", "--top-k", "1.5"], "argument --top-k: invalid int value: '1.5'"),
        (["generate", "--cpu-offload-gb", "inf"], "uva.cpu_offload_gb must be a finite number"),
        (["generate", "--cpu-offload-gb", "1e400"], "uva.cpu_offload_gb must be a finite number"),
        (["generate", "--offload-group-size", "1e400"], "invalid int value: '1e400'"),
        (["generate", "--swap-space", "inf"], "swap_space must be a number of GiB (finite"),
        (["generate", "--gpu-memory-utilization", "nan"], "gpu_memory_utilization must be"),
        (["generate", "--device-memory-gb", "inf"], "device_memory_gb must be a positive"),
        (["generate", "--max-model-len", "0"], "max_model_len must be an integer >= 1"),
        (["generate", "--repetition-penalty", "inf"], "repetition_penalty must be in (0.0, inf)"),
        (["demo", "--cpu-offload-gb", "inf"], "uva.cpu_offload_gb must be a finite number"),
        (["inspect", "llama-3-8b", "--cpu-offload-gb", "nan"], "uva.cpu_offload_gb must be"),
    ],
)
def test_numbers_from_flags_are_one_line_and_exit_2(argv, needle, capsys):
    status, last = _main(argv, capsys)
    assert status == 2 and last.startswith("offload: error: ") and needle in last, last


def test_a_tokenizer_larger_than_the_model_is_one_line_not_a_traceback(tmp_path, capsys):
    """The prompt's ids beyond the model's embedding were a 67-line IndexError traceback."""
    import zoo

    zoo.build("llama").save_pretrained(tmp_path)
    zoo._word_tokenizer(2 * zoo.VOCAB).save_pretrained(tmp_path)
    argv = ["generate", "--model", str(tmp_path), "--prompt", "t5 t200", "--no-progress"]
    status, err = _in_process(argv, capsys)
    assert status == 2 and "Traceback" not in err
    [line] = [line for line in err.splitlines() if line.strip()]
    assert line.startswith("offload: error: prompt 0 holds a token id the model cannot embed")
    assert "token ids in [0, 128), got 200" in line


def test_inspect_says_what_a_disk_tier_reads_per_forward(capsys, smollm2_path):
    # As stored: the 30 layers of 2.1 MiB all fit 0.1 GiB; 9 fit 0.02 GiB, 21 stream.
    assert main(["inspect", "--cpu-memory-gb", "0.1", "--disk-io", "direct"]) == 0
    out = capsys.readouterr().out
    assert "disk tier: every offloaded layer fits host memory (cpu_memory_gb 0.1)" in out
    assert main(["inspect", "--cpu-memory-gb", "0.02", "--disk-io", "direct"]) == 0
    streamed = "44.4 MiB read from the checkpoint's files per forward, 19.0 MiB kept"
    assert f"disk tier (direct io): {streamed}" in capsys.readouterr().out
    # The float32 conversion: 7 of the 30 layers of 13.5 MiB fit 0.1 GiB; 23 stream.
    floats = ["inspect", "--dtype", "float32", "--cpu-memory-gb", "0.1"]
    assert main([*floats, "--disk-io", "direct"]) == 0
    out = capsys.readouterr().out
    streamed = "310.6 MiB read from the checkpoint's files per forward, 94.5 MiB kept"
    assert f"disk tier (direct io): {streamed}" in out
    assert main([*floats, "--disk-io", "mmap"]) == 0
    out = capsys.readouterr().out
    assert "disk tier (mmap io): 310.6 MiB computed on in place (mapped) from the chec" in out


def test_help_and_bad_commands_start_without_torch():
    """The parser is built from torch-free modules and `offload`'s names load on first
    use: `--help` and a bad command answer at once (torch takes seconds to import)."""
    code = (
        "import sys\n"
        "from offload.cli.main import build_parser, main\n"
        "import offload\n"
        "build_parser().format_help()\n"
        "try:\n    main(['frobnicate'])\nexcept SystemExit as stop:\n    assert stop.code == 2\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert offload.OffloadConfig and 'torch' not in sys.modules\n"
        "assert offload.LLM and 'torch' in sys.modules  # (on first use)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_bench_methods_the_parser_names_are_the_benchs():
    from offload.bench import METHODS
    from offload.cli.options import BENCH_METHODS

    assert tuple(METHODS) == BENCH_METHODS


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["generat"], "(did you mean 'generate'?)"),
        (
            ["generate", "--temprature", "1"],
            "unrecognized arguments: --temprature 1 (did you mean '--temperature'?)",
        ),
        (["generate", "--max-token", "5"], "(did you mean '--max-tokens'?)"),  # no prefixes
        (["plan", "--remesure"], "(did you mean '--remeasure'?)"),
        (["bench", "--methods", "residnt"], "(did you mean 'resident'?)"),
    ],
)
def test_a_typo_gets_one_line_with_the_nearest_name(argv, hint, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and hint in err and err.count("\n") == 1, err


def test_mistyped_argument_names_get_the_nearest_in_python():
    from offload import LLM, SamplingParams

    with pytest.raises(TypeError, match=r"'max_token' \(did you mean 'max_tokens'\?\)"):
        SamplingParams(max_token=5)
    with pytest.raises(ConfigError, match=r"'cpu_ofload_gb' \(did you mean 'cpu_offload_gb'\?\)"):
        LLM(cpu_ofload_gb=1)
    assert SamplingParams(max_tokens=5, temperature=0).max_tokens == 5


@pytest.mark.parametrize("flags", [[], ["--enforce-eager"]])
def test_serve_enforce_eager_reaches_the_llm(tmp_path, monkeypatch, flags):
    """`offload serve --enforce-eager` serves without the compiled CPU step (it once
    compiled it all the same: the flag did not reach the LLM)."""
    from offload.cli.main import build_parser
    from offload.cli.serve import serve_llm
    from offload.config import OffloadConfig
    from tests import zoo

    monkeypatch.setenv("OFFLOAD_CPU_COMPILE", "1")
    path = zoo.save_attentive_llm(tmp_path / "tiny", num_layers=2)
    args = build_parser().parse_args(["serve", str(path), "--device", "cpu", *flags])
    llm = serve_llm(args, path, OffloadConfig.from_cli_args(args))
    try:
        assert llm._compile_cpu is not bool(flags)
    finally:
        llm.close()
