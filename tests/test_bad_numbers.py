"""A number no one could mean (1e300, infinity, nan, 2**70, a bool) given to any numeric
argument of any entry point (`LLM(...)`, `SamplingParams(...)`, an offload config as a
dict, the `offload` command's flags) is one line of ours naming the argument, raised
before any model is read: never an OverflowError from deeper down."""

import math

import pytest

from offload import LLM, OffloadConfig, OffloadError, SamplingParams
from offload.cli import main

BAD = {"1e300": 1e300, "inf": math.inf, "nan": math.nan, "2**70": 2**70, "True": True}

# The offload config's fields, by LLM's keyword (vLLM's flat names) and in a dict config.
CONFIG_ARGS = (
    "cpu_offload_gb",
    "cpu_memory_gb",
    "offload_group_size",
    "offload_num_in_group",
    "offload_prefetch_step",
    "read_ahead",
    "io_threads",
)
LLM_ARGS = (
    *CONFIG_ARGS,
    "swap_space",
    "gpu_memory_utilization",
    "device_memory_gb",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_logprobs",
    "seed",
    "tensor_parallel_size",
)
# repetition_penalty takes any positive number (1e300 too, as vLLM): it is in the table
# with the values it refuses only.
SAMPLING_ARGS = (
    "n",
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "logprobs",
    "prompt_logprobs",
    "truncate_prompt_tokens",
)


def _cases(entry: str, names: tuple[str, ...]) -> list:
    return [
        pytest.param(entry, name, value, id=f"{entry}-{name}-{shown}")
        for name in names
        for shown, value in BAD.items()
    ]


CASES = [
    *_cases("LLM", LLM_ARGS),
    *_cases("SamplingParams", SAMPLING_ARGS),
    *_cases("config", CONFIG_ARGS),
    *(
        pytest.param(
            "SamplingParams", "repetition_penalty", value, id=f"repetition_penalty-{value}"
        )
        for value in (math.inf, math.nan, True, -(2**70))
    ),
]


@pytest.fixture
def nothing_loads(monkeypatch):
    """Any step that reads a model fails the test: every check comes first."""
    import offload.cli.models as cli_models_module
    import offload.llm.args as llm_args_module
    import offload.llm.auto as auto_module
    import offload.llm.engine_args as engine_args_module
    import offload.llm.loading as loading_module

    for module, step in (
        (engine_args_module, "model_spec"),  # (LLM's model)
        (cli_models_module, "model_spec"),  # (a command's model)
        (llm_args_module, "load_tokenizer"),
        (loading_module, "load_model"),
        (auto_module, "measure"),
    ):
        monkeypatch.setattr(module, step, lambda *a, _s=step, **k: pytest.fail(f"{_s} ran"))


@pytest.mark.parametrize(("entry", "name", "value"), CASES)
def test_a_bad_number_is_one_line_naming_the_argument(
    smollm2_path, nothing_loads, entry, name, value
):
    calls = {
        "LLM": lambda: LLM(smollm2_path, **{name: value}),
        "SamplingParams": lambda: SamplingParams(**{name: value}),
        "config": lambda: OffloadConfig.from_dict({name: value}),
    }
    with pytest.raises(OffloadError) as info:
        calls[entry]()
    message = str(info.value)
    assert name in message and "\n" not in message, message


GENERATE_FLAGS = (
    "--cpu-offload-gb",
    "--cpu-memory-gb",
    "--offload-group-size",
    "--offload-prefetch-step",
    "--read-ahead",
    "--io-threads",
    "--swap-space",
    "--gpu-memory-utilization",
    "--device-memory-gb",
    "--max-model-len",
    "--max-num-batched-tokens",
    "--max-tokens",
    "--seed",
    "--temperature",
    "--top-p",
    "--top-k",
    "--min-p",
    "--presence-penalty",
)
PLAN_FLAGS = (
    "--context-len",
    "--max-batch",
    "--batch-size",
    "--cpu-memory-gb",
    "--device-memory-gb",
    "--gpu-memory-utilization",
)


@pytest.mark.parametrize(
    "text",
    ["1e300", "inf", "nan", str(2**70), "-1e300"],
    ids=["1e300", "inf", "nan", "2**70", "-1e300"],
)
@pytest.mark.parametrize(
    "argv",
    [["generate", "--no-offload", flag] for flag in GENERATE_FLAGS]
    + [["plan", flag] for flag in PLAN_FLAGS],
    ids=lambda argv: " ".join(argv),
)
def test_a_bad_number_flag_is_one_error_line_and_exit_2(nothing_loads, capsys, argv, text):
    try:
        status = main([*argv, text])
    except SystemExit as done:  # argparse's own errors (an int flag given "1e300")
        status = done.code
    lines = capsys.readouterr().err.strip().splitlines()
    flag = argv[-1]
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith("offload: error: ")
    assert flag in lines[0] or flag.strip("-").replace("-", "_") in lines[0], lines[0]
