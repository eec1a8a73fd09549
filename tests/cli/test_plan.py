"""`offload plan`: a plan for a tiny model, measured once and then read from the cache; bad
input is one line on stderr, exit status 2, and measures nothing."""

import dataclasses
import importlib
import json
import re
import shlex

import pytest
import transformers
import zoo

from offload.bench.checkpoint import write_random_checkpoint
from offload.cli import main
from offload.cli.main import build_parser


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    return zoo.save_with_tokenizer(zoo.build("llama"), tmp_path / "model")


def test_plan_prints_the_choice_flags_and_prediction(tiny, tmp_path, capsys):
    # One batch size: which is fastest would depend on timings of a loaded machine.
    argv = ["plan", "--model", str(tiny), "--batch-size", "2", "--context-len", "64"]
    assert main([*argv, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"plan for {tiny} (float32) on cpu, decoding with 64 positions" in out
    assert "chosen: resident, batch 2\n  predicted step " in out
    assert "tokens/s (compute-bound: compute " in out
    flags = f"--model {tiny} --device cpu --max-model-len 64"
    assert f"offload generate flags (with 2 prompts a call):\n  {flags}\n" in out
    generate = build_parser().parse_args(["generate", *shlex.split(flags)])  # runs as printed
    assert (generate.model, generate.device, generate.max_model_len) == (str(tiny), "cpu", 64)
    assert "vllm serve flags:\n  --max-num-seqs 2 --max-model-len 64\n" in out
    assert "warning: the model fits: no offloading needed" in out
    assert "measurements: taken now, cached in " + str(tmp_path / "cache" / "plans") in out
    assert main(argv) == 0
    assert "measurements: cached " in capsys.readouterr().out
    assert main([*argv, "--remeasure"]) == 0
    assert "measurements: taken now" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--context-len", "0"], "context_len must be in [1, 2048] for this model, got 0"),
        (["--max-batch", "0"], "max_batch must be an integer >= 1, got 0"),
        (["--batch-size", "2", "--max-batch", "4"], "not allowed with argument"),
        (["--cpu-memory-gb", "-1"], "cpu_memory_gb must be a finite number >= 0, got -1.0"),
        (["--device-memory-gb", "0"], "device_memory_gb must be a positive, finite number"),
        (["--dtype", "int8"], "invalid choice: 'int8'"),
        (["--batch-size", "x"], "invalid int value: 'x'"),
        (["-q", "bogus"], "quantization must be None or one of gguf, "),
        (["-q", "gguf"], "quantization='gguf' needs a .gguf file or a folder offload made"),
    ],
)
def test_bad_input_is_one_line_and_measures_nothing(tiny, tmp_path, capsys, argv, message):
    try:
        status = main(["plan", "--model", str(tiny), *argv])
    except SystemExit as exit:  # argparse's own errors
        status = exit.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and "Traceback" not in err
    assert lines[-1].startswith("offload: error: ") and message in lines[-1]
    assert not (tmp_path / "cache" / "plans").exists()


def test_a_quantized_model_is_planned_as_stored_and_its_header_says_so(tmp_path, capsys):
    """The header names the form planned: the weights as stored, not the compute dtype
    alone (the default model's said "float32" of its Q4_1 weights)."""
    shape = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
    ).to_dict()  # fmt: skip
    shape.pop("dtype", None)
    shape.pop("torch_dtype", None)
    q4_0 = tmp_path / "q4_0"
    write_random_checkpoint(q4_0, shape, max_shard_bytes=10**7, quantized="Q4_0")
    argv = ["plan", "--model", str(q4_0), "--batch-size", "1", "--context-len", "32"]
    for quantization in ([], ["-q", "gguf"]):  # (read from its config, or named)
        assert main([*argv, "--device", "cpu", *quantization]) == 0
        out = capsys.readouterr().out
        assert f"plan for {q4_0} (GGUF Q4_0 as stored, computing in float32) on cpu" in out
        named = " --quantization gguf" if quantization else ""
        flags = f"--model {q4_0} --device cpu{named} --max-model-len 32"
        assert f"offload generate flags (with 1 prompt a call):\n  {flags}\n" in out


def test_nothing_fits_is_one_line(tiny, capsys):
    argv = ["plan", "--model", str(tiny), "--max-batch", "1", "--device-memory-gb", "0.05"]
    assert main([*argv, "--context-len", "16"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("offload: error: no placement fits: the device budget is 46.1 MiB")


def test_a_missing_model_is_one_line(tmp_path, capsys):
    assert main(["plan", "--model", str(tmp_path / "nothing")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("offload: error: ") and "nothing" in line


def test_a_cpu_budget_bounds_the_plan_what_it_measures_and_its_flags(tmp_path, monkeypatch):
    """16 layers of 4.2 MiB (float32) against 0.1 GiB of RAM: not resident (the stack and
    the slack alone pass it), layers read from disk, only the batches whose KV cache the
    budget holds measured, and flags that carry the budget."""
    import json

    from small_probes import SMALL_PROBES

    from offload.cli.plan import describe
    from offload.llm.auto import plan_for

    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    shape = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=256, max_position_embeddings=256,
    ).to_dict()  # fmt: skip
    shape.pop("dtype", None)
    shape.pop("torch_dtype", None)
    model = tmp_path / "model"
    write_random_checkpoint(model, shape, max_shard_bytes=2**24)
    plan = plan_for(
        model, "cpu", context_len=128, max_batch=8, cpu_memory_gb=0.1, settings=SMALL_PROBES
    )
    # 4 MiB of KV cache a sequence: batch 8 does not fit beside the slots and the slack.
    measured = json.loads(plan.measured.path.read_text())
    assert measured["batch_sizes"] == [1, 2, 4]
    assert plan.chosen.layout.offloaded_bytes and plan.chosen.ram.total_bytes <= 0.1 * 2**30
    out = describe(plan, ["--model", str(model), "--device", "cpu"])
    assert "chosen: resident" not in out and "of the 102.4 MiB RAM budget (" in out
    flags = out.split("offload generate flags", 1)[1].splitlines()[1]
    assert "--cpu-memory-gb 0.1 --disk-io direct" in flags
    generate = build_parser().parse_args(["generate", *shlex.split(flags)])
    assert (generate.cpu_memory_gb, generate.max_model_len) == (0.1, 128)
    # Where `offload generate` takes the KV cache's size, a batch's is printed too.
    plan = dataclasses.replace(plan, chosen=dataclasses.replace(plan.chosen, batch_size=2))
    out = describe(plan, ["--model", str(model)], {"--kv-cache-memory-bytes"})
    assert f"--kv-cache-memory-bytes {2 * 4 * 2**20}\n" in out  # 2 x 4 MiB at 128 positions


def test_a_default_context_too_long_for_the_budget_shrinks_and_an_asked_one_does_not(
    tiny, monkeypatch, capsys, caplog
):
    """As an LLM's: the default context shrinks to the longest power of two that fits the
    budget (a line says so) and the flags printed carry it; one asked for is refused."""
    from offload.llm import auto

    plan = importlib.import_module("offload.planner.plan")  # (the module, not its function)
    fits = auto.fits_at_all

    def short_only(shape, budgets, batch, length):
        return length <= 300 and fits(shape, budgets, batch, length)

    monkeypatch.setattr(auto, "fits_at_all", short_only)
    monkeypatch.setattr(plan, "fits_at_all", short_only)
    argv = ["plan", "--model", str(tiny), "--batch-size", "1", "--device", "cpu"]
    assert main([*argv, "--cpu-memory-gb", "4"]) == 0
    assert "decoding with 256 positions of context" in capsys.readouterr().out
    assert "context_len 1024 does not fit the memory budget" in caplog.text
    assert main([*argv, "--cpu-memory-gb", "4", "--context-len", "512"]) == 2
    assert "error:" in capsys.readouterr().err


def test_plan_predicts_speculation_and_refuses_a_missing_draft(tiny, tmp_path, capsys):
    argv = ["plan", "--model", str(tiny), "--batch-size", "1", "--context-len", "64"]
    missing = '{"model": "%s"}' % (tmp_path / "nowhere")
    assert main([*argv, "--speculative-config", missing]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("offload: error: speculative_config: the draft model ")
    assert "is no checkpoint here" in err and "\n" not in err
    assert not (tmp_path / "cache" / "plans").exists()  # (refused before measuring)
    assert main([*argv, "--speculative-config", '{"method": "ngram"}']) == 0
    out = capsys.readouterr().out
    assert "speculative decoding by n-gram lookup, taking 50% of guesses kept" in out
    weighed = out.split("the engine measures its own as it runs):\n  ")[1].split("\n")[0]
    assert weighed.startswith("k=1 ") and ", k=16 " in weighed
    chosen = [line for line in out.splitlines() if "chosen k=" in line or "not predicted" in line]
    assert len(chosen) == 1
    flags = out.split("offload generate flags")[1].split("\n")[1]
    assert ("--speculative-config" in flags) == ("chosen k=" in chosen[0])
    assert main([*argv, "--speculative-config", '{"method": "eagle"}']) == 2
    assert "'eagle' is not available here" in capsys.readouterr().err


def test_the_printed_flag_keeps_a_tree_as_asked_holding_the_k_chosen():
    from offload.cli.plan import speculation_lines
    from offload.engine.speculative import SpeculativeConfig
    from offload.planner.speculation import Speculation

    chosen = Speculation(3, 0.5, 1.875, 1.0, 1.5)
    config = SpeculativeConfig.of({"method": "ngram", "tree_budget": 1})
    lines, flags = speculation_lines(config, chosen, [chosen])
    assert flags[0] == "--speculative-config"
    assert json.loads(flags[1]) == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "tree_budget": 3,
    }
    assert "chosen k=3: 1.88 tokens a forward, 2.81x" in "\n".join(lines)
    off = Speculation(0, 0.5, 1.0, 1.0, 1.0)
    lines, flags = speculation_lines(config, off, [chosen])
    assert flags == [] and "not predicted to pay" in lines[-1]


def test_plan_splits_the_layers_over_pipeline_ranks(tiny, capsys):
    """`--pipeline-parallel-size 2`: each rank's layers (contiguous, every one once, the
    head on the last), its bytes and step within its budget, the pipeline's step (the
    stages' sum) and the flag."""
    argv = ["plan", "--model", str(tiny), "--batch-size", "1", "--context-len", "64"]
    assert main([*argv, "--pipeline-parallel-size", "2", "--cpu-memory-gb", "4"]) == 0
    out = capsys.readouterr().out.split("pipeline of 2 ranks, within 4.0 GiB of RAM each")[1]
    ranks = re.findall(
        r"rank (\d): layers (\d+)-(\d+)( and the head)?, .*: ([\d.]+) ms a step", out
    )
    assert [(r[0], r[3]) for r in ranks] == [("0", ""), ("1", " and the head")]
    layers = [i for r in ranks for i in range(int(r[1]), int(r[2]) + 1)]
    assert layers == list(range(len(layers))) and len(layers) > 2
    step = float(re.search(r"predicted step ([\d.]+) ms", out)[1])
    assert step == pytest.approx(sum(float(r[4]) for r in ranks), abs=0.2)
    assert "flag: --pipeline-parallel-size 2" in out
