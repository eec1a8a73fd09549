"""`offload inspect`: the model given as every command takes it (`--model`) or as MODEL,
and on a CPU the budget rule for it: the fixed overhead, what a `--cpu-memory-gb` budget
holds and what is left of it for layers kept in RAM."""

from offload.cli import main


def _inspected(argv, capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        status = main(["inspect", *argv])
    except SystemExit as done:  # argparse's own errors
        status = done.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_the_model_is_taken_as_every_command_takes_it(capsys):
    flags = ["--device", "cpu", "--max-model-len", "512"]
    status, by_flag, err = _inspected(["--model", "llama-3-8b", *flags], capsys)
    assert status == 0 and err == ""  # (it once said: did you mean '--max-model-len'?)
    assert "LlamaForCausalLM" in by_flag.splitlines()[0]
    assert _inspected(["llama-3-8b", *flags], capsys)[1] == by_flag  # positional, as before
    assert _inspected(["llama-3-8b", "--model", "llama-3-8b", *flags], capsys)[1] == by_flag


def test_two_different_models_are_one_line(capsys):
    status, _, err = _inspected(["llama-3-8b", "--model", "llama-3-70b"], capsys)
    (line,) = err.splitlines()
    assert status == 2 and line == (
        "offload: error: the model is given twice, as MODEL 'llama-3-8b' and --model "
        "'llama-3-70b': give one of them"
    )


def test_on_a_cpu_it_states_the_overhead_and_what_the_budget_holds(capsys, smollm2_path):
    argv = ["--model", str(smollm2_path), "--device", "cpu", "--max-model-len", "1024"]
    status, out, _ = _inspected(argv, capsys)
    assert status == 0
    assert (
        "  fixed overhead " in out and ", tokenizer 0.0" in out and "RSS beside any budget" in out
    )
    assert "no RAM budget given (--cpu-memory-gb GIB bounds peak RSS to GIB + it)" in out
    budget = [*argv, "--cpu-memory-gb", "0.25", "--disk-io", "direct"]
    status, out, _ = _inspected(budget, capsys)
    assert status == 0
    assert "  RAM budget 256.0 MiB (--cpu-memory-gb): peak RSS within " in out
    assert "(45.0 MiB a sequence of 1024 positions)" in out
    assert "every layer resident needs " in out and " from disk each step (" in out
    status, out, _ = _inspected([*argv, "--cpu-memory-gb", "0.01"], capsys)
    assert status == 0 and "cpu_memory_gb=0.01 GiB cannot hold one sequence of 1024" in out
