"""The `offload` command. Errors are one line on stderr and a non-zero exit."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from offload.config import OffloadConfig, add_cli_args
from offload.errors import OffloadError

_QUESTION = "What is the capital of France?"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit status 2, as argparse does
        self.exit(2, f"offload: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="offload", description="Offload model weights to host memory.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo = commands.add_parser(
        "demo",
        help="offload the default model (SmolLM2-135M-Instruct), answer a question, show what moved",
    )
    demo.add_argument(
        "--model", help="a Hugging Face model directory (default: SmolLM2-135M-Instruct)"
    )
    demo.add_argument(
        "--prompt", default=_QUESTION, help="the user message (chat template applied)"
    )
    demo.add_argument("--max-tokens", type=int, default=24, help="tokens to generate (greedy)")
    demo.add_argument("--device", default="cpu", help="compute device, e.g. cpu or cuda")
    add_cli_args(demo)

    generate = commands.add_parser(
        "generate", help="generate text with offloading (default: SmolLM2)"
    )
    generate.add_argument("--model", help="a model directory with safetensors weights")
    generate.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    generate.add_argument(
        "--chat", action="store_true", help="apply the chat template to the prompts"
    )
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--min-p", type=float, default=0.0)
    generate.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="> 1 discourages tokens seen in the prompt or output",
    )
    generate.add_argument(
        "--presence-penalty", type=float, default=0.0, help="in [-2, 2], once per generated token"
    )
    generate.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="in [-2, 2], times how often a token was generated",
    )
    generate.add_argument("--seed", type=int)
    generate.add_argument("--stop", action="append", help="a stop string (repeatable)")
    generate.add_argument("--max-model-len", type=int)
    generate.add_argument(
        "--max-num-batched-tokens", type=int, help="prefill prompts in chunks of this many tokens"
    )
    generate.add_argument(
        "--no-offload", action="store_true", help="keep every weight on the device"
    )
    generate.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    generate.add_argument(
        "--device-memory-gb", type=float, help="pretend the device has this much memory"
    )
    generate.add_argument(
        "--swap-space",
        type=float,
        default=0,
        help="GiB of host memory for the KV cache (> 0 keeps the KV cache in host memory)",
    )
    generate.add_argument(
        "--kv-offload", action="store_true", help="keep the KV cache in host memory"
    )
    generate.add_argument(
        "--no-progress", action="store_true", help="no progress bars (loading, prompts)"
    )
    generate.add_argument(
        "--enforce-eager", action="store_true", help="decode without CUDA graphs (GPU)"
    )
    _device_flags(generate)
    add_cli_args(generate)

    inspect = commands.add_parser(
        "inspect", help="a model's layers and sizes, and what a config offloads"
    )
    inspect.add_argument("path", help="a model directory (config.json is enough)")
    _device_flags(inspect)
    add_cli_args(inspect)
    return parser


def _device_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="compute device, e.g. cpu or cuda")
    parser.add_argument(
        "--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16")
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the Python code a checkpoint ships (its auto_map); off: never run it",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            return _demo(args)
        from offload import commands as run

        print(run.generate(args) if args.command == "generate" else run.inspect(args))
        return 0
    except OffloadError as error:
        print(f"offload: error: {error}", file=sys.stderr)
    except OSError as error:  # unreadable files, a tokenizer missing from the model folder
        print(f"offload: error: {error.strerror or error}", file=sys.stderr)
    except KeyboardInterrupt:
        print("offload: interrupted", file=sys.stderr)
        return 130  # the shell's status for SIGINT
    return 2


def _demo(args: argparse.Namespace) -> int:
    from offload.demo import run_demo

    if args.max_tokens < 1:
        raise OffloadError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    config = OffloadConfig.from_cli_args(args)
    started = time.perf_counter()
    report = run_demo(args.model, args.prompt, args.max_tokens, args.device, config)
    print(report)
    print(f"({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":  # python -m offload.cli
    sys.exit(main())
