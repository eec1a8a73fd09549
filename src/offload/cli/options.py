"""Flags that several commands share (budgets, device) and `generate`'s sampling flags,
each default taken from where it is defined."""

from __future__ import annotations

import argparse
import dataclasses
from importlib import metadata

from offload.config.limits import GPU_MEMORY_UTILIZATION
from offload.engine.sampling_params import SamplingParams
from offload.memory.placement import AUTO

QUESTION = "What is the capital of France?"  # what generate and demo ask by default
# `offload bench --methods`, by name (the parser is built without importing the bench
# and torch; tests/bench checks these against offload.bench.METHODS).
BENCH_METHODS = (
    "resident", "llm", "llm-ngram", "llm-draft", "uva", "prefetch-all", "prefetch-half", "disk", "disk-direct", "plan",
    "accelerate-map", "accelerate-disk", "diffusers", "llama-cpp",
)  # fmt: skip

_SAMPLING = {field.name: field.default for field in dataclasses.fields(SamplingParams)}
# The sampling flags of `generate` with a default: (flag, type, default, help).
# SamplingParams' defaults, except that the command decodes greedily unless told.
SAMPLING_FLAGS = (
    ("--temperature", float, 0.0, "0: greedy"),
    ("--top-p", float, _SAMPLING["top_p"], "sample from this much probability mass"),
    ("--top-k", int, _SAMPLING["top_k"], "sample from this many tokens (0: all)"),
    ("--min-p", float, _SAMPLING["min_p"], "drop tokens below this share of the best"),
    (
        "--repetition-penalty",
        float,
        _SAMPLING["repetition_penalty"],
        "> 1 discourages tokens seen in the prompt or output",
    ),
    (
        "--presence-penalty",
        float,
        _SAMPLING["presence_penalty"],
        "in [-2, 2], once per generated token",
    ),
    (
        "--frequency-penalty",
        float,
        _SAMPLING["frequency_penalty"],
        "in [-2, 2], times how often a token was generated",
    ),
)
SPECULATIVE_HELP = (
    'speculative decoding, as vLLM\'s: e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
    '"prompt_lookup_max": 4}\' or \'{"model": DRAFT}\' (guesses chosen as it runs where '
    'num_speculative_tokens is left out; "tree_budget": N scores a tree of N) (default: none)'
)
DEVICE_HELP = "compute device: auto (a GPU if one is usable, else the CPU), cpu, cuda, cuda:N"


def add_budget_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=GPU_MEMORY_UTILIZATION,
        help="share of the device's memory that weights, KV cache and activations may use",
    )
    parser.add_argument(
        "--device-memory-gb",
        type=float,
        help="pretend the device has this many GiB (to plan for a smaller GPU; default: "
        "its real memory)",
    )


def add_parallel_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's --pipeline-parallel-size (generate, serve, plan)."""
    parser.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="processes, each holding a stage of the decoder layers with its own "
        "offloading, started here (or by torchrun, one per rank) (default: 1)",
    )


def add_micro_batch_flag(parser: argparse.ArgumentParser) -> None:
    """--pipeline-micro-batches (serve): engine cores in flight over the pipeline."""
    parser.add_argument(
        "--pipeline-micro-batches",
        type=int,
        help="micro-batches in flight over the pipeline's ranks, each a scheduler of its "
        "own (default: one per rank where each computes on its own host or GPU, else 1; "
        "no effect without --pipeline-parallel-size)",
    )


def add_kv_memory_flag(parser: argparse.ArgumentParser) -> None:
    """vLLM's --kv-cache-memory-bytes: the KV cache's size, given (generate, serve)."""
    parser.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        help="bytes of KV cache (on a CPU with --cpu-memory-gb, its share of the budget; "
        "default: what the budget leaves, or the free memory there is)",
    )


def add_weight_flags(parser: argparse.ArgumentParser, quantization_help: str) -> None:
    """-q/--quantization (its help per command) and --dtype."""
    parser.add_argument("-q", "--quantization", help=quantization_help)
    parser.add_argument(
        "--dtype",
        default=AUTO,
        choices=("auto", "float32", "bfloat16", "float16"),
        help="weights' dtype (auto: the checkpoint's)",
    )


def add_device_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=AUTO, help=DEVICE_HELP)
    add_weight_flags(
        parser,
        "the checkpoint's quantization as vLLM names it (gguf, gptq, awq, compressed-tensors, "
        "fp8); gguf: a .gguf model's weights as stored (2-8 bits a weight), not converted to "
        "float32 (default: read from the checkpoint; a .gguf as stored with --dtype auto "
        "where torch has an int4 kernel for the device (a CPU's; a GPU's from sm_80), else "
        "converted)",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the Python code a checkpoint ships (its auto_map); off: never run it",
    )


def package_version() -> str:
    try:
        return metadata.version("offload")
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"
