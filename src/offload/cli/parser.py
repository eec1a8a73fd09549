"""The `offload` command's parser: its commands and flags (`main.py` runs them)."""

from __future__ import annotations

import argparse

from offload.cli.options import (
    BENCH_METHODS,
    DEVICE_HELP,
    QUESTION,
    SAMPLING_FLAGS,
    SPECULATIVE_HELP,
    add_budget_flags,
    add_device_flags,
    add_kv_memory_flag,
    add_micro_batch_flag,
    add_parallel_flags,
    add_weight_flags,
    package_version,
)
from offload.config import add_cli_args
from offload.config.limits import DEFAULT_CONTEXT_LEN, DEFAULT_MAX_BATCH
from offload.errors import did_you_mean
from offload.memory.placement import AUTO


class _Parser(argparse.ArgumentParser):
    """One-line errors with a "did you mean" for a mistyped command or flag; a flag is
    never taken from a prefix of it (`--max-token` is not `--max-tokens`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _ShowDefaults)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:  # said by the command's own parser, which knows its flags
            command = self._commands().get(getattr(parsed, "command", None), self)
            flags = [a.split("=")[0] for a in extra if a.startswith("-")]
            hint = did_you_mean(flags[0], command._option_string_actions) if flags else ""
            command.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
        return parsed

    def _commands(self) -> dict[str, argparse.ArgumentParser]:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}

    def error(self, message: str) -> None:  # one line, exit status 2, as argparse does
        if "invalid choice: " in message and "did you mean" not in message:
            wrong = message.split("invalid choice: ", 1)[1].split(" ", 1)[0].strip("'\"")
            choices = self._commands() or [c for a in self._actions if a.choices for c in a.choices]
            message += did_you_mean(wrong, choices)
        self.exit(2, f"offload: error: {message}\n")


def one_line_warning(message, category, filename, lineno, line=None) -> str:
    kind = "" if category is UserWarning else f" ({category.__name__})"
    return f"offload: warning{kind}: {message}\n"


class _ShowDefaults(argparse.HelpFormatter):
    """Each flag's help ends with its default, where it has one (not None or off; a 0 is
    a default, so the test is by identity: 0 == False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "%(default)" in text or any(default is v for v in (None, False, argparse.SUPPRESS)):
            return text
        if not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="offload",
        description="Run models larger than the GPU: weights (and the KV cache) in host memory, "
        "brought in as each layer runs. Flags are vLLM's.",
    )
    parser.add_argument("--version", action="version", version=f"offload {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_demo(commands)
    _add_generate(commands)
    _add_inspect(commands)
    _add_bench(commands)
    _add_plan(commands)
    _add_serve(commands)
    return parser


def _add_serve(commands: argparse._SubParsersAction) -> None:
    """`offload serve`: vLLM's OpenAI-compatible server, with offloading."""
    from offload.cli.serve import add_serve_flags

    serve = commands.add_parser(
        "serve", help="an OpenAI-compatible server (continuous batching, offloaded weights)"
    )
    add_serve_flags(serve)
    add_kv_memory_flag(serve)
    add_parallel_flags(serve)
    add_micro_batch_flag(serve)
    add_budget_flags(serve)
    add_device_flags(serve)
    add_cli_args(serve)


def _add_demo(commands: argparse._SubParsersAction) -> None:
    """`offload demo`: the default model offloaded, resident and offloaded answers compared."""
    demo = commands.add_parser(
        "demo",
        help="offload the default model (SmolLM2-135M-Instruct), answer a question, show what moved",
    )
    demo.add_argument(
        "--model", help="a Hugging Face model directory (default: SmolLM2-135M-Instruct)"
    )
    demo.add_argument("--prompt", default=QUESTION, help="the user message (chat template applied)")
    demo.add_argument("--max-tokens", type=int, default=24, help="tokens to generate (greedy)")
    demo.add_argument("--device", default=AUTO, help=DEVICE_HELP)
    add_cli_args(demo)


def _add_generate(commands: argparse._SubParsersAction) -> None:
    """`offload generate`: vLLM's generation flags, budgets, devices and offload flags."""
    generate = commands.add_parser(
        "generate", help="generate text with offloading (default: SmolLM2)"
    )
    generate.add_argument(
        "--model",
        help="a folder with safetensors or pytorch_model*.bin weights, a .gguf file, or a "
        "Hugging Face id (default: SmolLM2-135M-Instruct)",
    )
    generate.add_argument(
        "--prompt",
        action="append",
        help="a prompt (repeat for a batch; several answers are written whole, each "
        f"labelled; default: {QUESTION!r} as a chat)",
    )
    generate.add_argument(
        "--chat", action="store_true", help="apply the chat template to the prompts"
    )
    generate.add_argument("--max-tokens", type=int, default=64, help="new tokens at most")
    for flag, kind, default, text in SAMPLING_FLAGS:
        generate.add_argument(flag, type=kind, default=default, help=text)
    generate.add_argument("--seed", type=int, help="make sampling reproducible (default: unseeded)")
    generate.add_argument(
        "--stop", action="append", help="a stop string (repeatable; default: none)"
    )
    generate.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="prefill prompts in chunks of this many tokens, each riding in the running "
        "sequences' decode step (default: on a CPU, as many a step as measured time "
        "allows while sequences decode; else each prompt whole)",
    )
    generate.add_argument("--speculative-config", metavar="JSON", help=SPECULATIVE_HELP)
    _run_flags(generate)
    _model_run_flags(generate, "prompt plus output at most (default: the model's)")


def _model_run_flags(parser: argparse.ArgumentParser, max_model_len: str) -> None:
    """What `generate` and `inspect` share: the context length (`max_model_len` says
    what it is to the command), the device, and the offload settings."""
    parser.add_argument("--max-model-len", type=int, help=max_model_len)
    add_device_flags(parser)
    add_cli_args(parser)


def _run_flags(parser: argparse.ArgumentParser) -> None:
    """How `generate` runs: offloading off, memory budgets, the KV cache's place, output."""
    parser.add_argument("--no-offload", action="store_true", help="keep every weight on the device")
    add_budget_flags(parser)
    add_parallel_flags(parser)
    parser.add_argument(
        "--swap-space",
        type=float,
        default=0,
        help="GiB of host memory for the KV cache (> 0 keeps the KV cache in host memory)",
    )
    add_kv_memory_flag(parser)
    parser.add_argument(
        "--kv-offload", action="store_true", help="keep the KV cache in host memory"
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bars (loading, prompts)"
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="decode eagerly: no CUDA graphs on a GPU, no compiled step on a CPU",
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="each answer the same alone or beside others (as VLLM_BATCH_INVARIANT=1): "
        "eager steps, each prompt prefilled alone",
    )
    parser.add_argument(
        "--no-stream",
        action="store_true",
        help="write the answer when it is complete, not as it is generated",
    )


def _add_inspect(commands: argparse._SubParsersAction) -> None:
    """`offload inspect`: a model's layers and sizes, and what a config would offload."""
    inspect = commands.add_parser(
        "inspect", help="a model's layers and sizes, and what a config offloads"
    )
    model_help = (
        "a model folder (config.json is enough), a .gguf file or a shipped shape such as "
        "llama-3-8b (default: SmolLM2-135M-Instruct)"
    )
    inspect.add_argument("path", nargs="?", metavar="MODEL", help=f"{model_help}; or --model")
    inspect.add_argument("--model", help=model_help)
    add_budget_flags(inspect)
    _model_run_flags(inspect, "positions the KV cache holds (default: the model's)")


def _add_bench(commands: argparse._SubParsersAction) -> None:
    """`offload bench`: one workload through every method side by side, with the bounds."""
    bench = commands.add_parser(
        "bench",
        help="tokens/s of every offloading method (ours, accelerate, diffusers) side by side, "
        "beside this machine's bounds; a table, JSON and a PNG",
    )
    bench.add_argument(
        "--model",
        help="a model folder, a .gguf file, or a shipped shape such as llama-3-8b (random "
        "weights, written once into the cache folder) (default: SmolLM2-135M-Instruct)",
    )
    add_weight_flags(
        bench,
        "gguf: the GGUF's weights as stored (2-8 bits a weight), not converted to float32; "
        "with a shape, its matrices as random Q4_0 blocks (default: converted)",
    )
    bench.add_argument("--device", default=AUTO, help=DEVICE_HELP)
    bench.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[1, 8, 32], help="prompts decoded at once"
    )
    bench.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt")
    bench.add_argument("--output-len", type=int, default=8, help="tokens generated (>= 2)")
    bench.add_argument("--rounds", type=int, default=5, help="timed rounds after the warm-up")
    bench.add_argument(
        "--methods",
        nargs="+",
        choices=list(BENCH_METHODS),
        metavar="METHOD",
        help=f"what to run, of: {', '.join(BENCH_METHODS)} (default: all; diffusers on a GPU only)",
    )
    bench.add_argument("--out", default="offload-bench", help="folder for the JSON and PNG")
    bench.add_argument(
        "--wide", action="store_true", help="every column (the planner's predictions, rates)"
    )
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")


_PLAN_MODEL_HELP = (
    "a model folder, a Hugging Face id or a shipped shape such as llama-3-8b "
    "(default: SmolLM2-135M-Instruct)"
)


def _add_plan(commands: argparse._SubParsersAction) -> None:
    """`offload plan`: measure this machine, choose the offloading and batch size."""
    plan = commands.add_parser(
        "plan", help="measure this machine and choose the offloading setting and batch size"
    )
    plan.add_argument("--model", help=_PLAN_MODEL_HELP)
    batch = plan.add_mutually_exclusive_group()
    batch.add_argument(
        "--batch-size",
        type=int,
        help="plan for this batch size only (default: the best up to --max-batch)",
    )
    batch.add_argument(
        "--max-batch",
        type=int,
        default=DEFAULT_MAX_BATCH,
        help="weigh batch sizes 1, 2, 4, ... up to this",
    )
    plan.add_argument(
        "--context-len",
        type=int,
        help=f"positions each sequence's KV cache holds (default: {DEFAULT_CONTEXT_LEN})",
    )
    plan.add_argument(
        "--cpu-memory-gb",
        type=float,
        metavar="GIB",
        help="host memory for weights kept off the device, the rest streaming from disk; on "
        "a CPU the one RAM budget (layers kept, slots, KV cache, activations) that peak RSS "
        "stays within, beside the fixed overhead plan states (default: the RAM available)",
    )
    plan.add_argument(
        "--remeasure", action="store_true", help="measure again instead of using the cache"
    )
    plan.add_argument(
        "--speculative-config",
        metavar="JSON",
        help="also predict speculative decoding (as generate's flag; num_speculative_tokens "
        "may be left out) and choose its number of guesses for the plan (default: not weighed)",
    )
    add_budget_flags(plan)
    add_parallel_flags(plan)
    add_device_flags(plan)
