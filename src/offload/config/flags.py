"""vLLM's weight-offloading flags (`--cpu-offload-gb`, `--offload-group-size`, ...):
adding them to a parser, and reading them back as the keys of an offload config."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from offload.config.parts import BACKENDS, DISK_IO, PREFETCH_UNITS
from offload.errors import ConfigError
from offload.memory.placement import AUTO, Auto


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print usage and exit
        raise ConfigError(message)


def _gib_or_auto(text: str) -> float | Auto:
    if text == AUTO:
        return AUTO
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of GiB or 'auto', got {text!r}"
        ) from None


# (flag, dest, argparse keywords): vLLM's names, plus the two switches vLLM keeps in env vars.
_FLAGS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    (
        "--offload-backend",
        "offload_backend",
        {
            "choices": BACKENDS,
            "help": "auto (the default): prefetch if --offload-group-size > 0 or --cpu-memory-gb "
            "is given, else UVA if --cpu-offload-gb > 0",
        },
    ),
    (
        "--cpu-offload-gb",
        "cpu_offload_gb",
        {
            "type": _gib_or_auto,
            "metavar": "GIB|auto",
            "help": "UVA: GiB of weights kept in host memory and read in place (auto: just enough to fit; vLLM default 0)",
        },
    ),
    (
        "--cpu-offload-params",
        "cpu_offload_params",
        {
            "nargs": "+",
            "metavar": "SEG",
            "help": "UVA: only parameters whose names contain these dot-separated segments "
            "(default: any)",
        },
    ),
    (
        "--offload-group-size",
        "offload_group_size",
        {
            "type": int,
            "metavar": "N",
            "help": "prefetch: of every N layers, the last --offload-num-in-group are offloaded (vLLM default 0: off)",
        },
    ),
    (
        "--offload-num-in-group",
        "offload_num_in_group",
        {
            "type": int,
            "metavar": "N",
            "help": "prefetch: layers offloaded per group (vLLM default 1)",
        },
    ),
    (
        "--offload-prefetch-step",
        "offload_prefetch_step",
        {
            "type": int,
            "metavar": "N",
            "help": "prefetch: how many layers ahead copies run; device slots (vLLM default 1)",
        },
    ),
    (
        "--offload-params",
        "offload_params",
        {
            "nargs": "+",
            "metavar": "SEG",
            "help": "prefetch: only parameters whose names contain these segments (default: "
            "all of an offloaded layer's)",
        },
    ),
    (
        "--offload-disable-uva",
        "disable_uva",
        {
            "action": "store_const",
            "const": True,
            "help": "UVA: copy each layer to the device before it runs instead of reading host memory in place",
        },
    ),
    (
        "--offload-disable-pin-memory",
        "disable_pin_memory",
        {"action": "store_const", "const": True, "help": "keep host memory pageable (not pinned)"},
    ),
    (
        "--cpu-memory-gb",
        "cpu_memory_gb",
        {
            "type": float,
            "metavar": "GIB",
            "help": "disk tier (ours): GiB of host memory for offloaded layers; the rest stream from the checkpoint's files (0: all; default: no disk tier). On a CPU, the whole process's budget beyond a fixed overhead: layers, KV cache, activations (docs/guide.md, Memory)",
        },
    ),
    (
        "--offload-folder",
        "offload_folder",
        {
            "metavar": "DIR",
            "help": "disk tier: where a checkpoint that is not safetensors is converted once "
            "(default: in the offload cache, ~/.cache/offload)",
        },
    ),
    (
        "--read-ahead",
        "read_ahead",
        {"type": int, "metavar": "N", "help": "disk tier: layers read ahead of use (default 2)"},
    ),
    (
        "--disk-io",
        "disk_io",
        {
            "choices": DISK_IO,
            "help": "disk tier: direct reads around the page cache, reads through it (pages stay "
            "cached), or compute on mapped files (CPU); auto (the default) maps a checkpoint "
            "already in the page cache on the CPU, else reads directly",
        },
    ),
    (
        "--io-threads",
        "io_threads",
        {"type": int, "metavar": "N", "help": "disk tier: reading threads (default 2)"},
    ),
    (
        "--offload-prefetch-unit",
        "prefetch_unit",
        {
            "choices": PREFETCH_UNITS,
            "help": "prefetch: what one copy brings in (ours; auto, the default: layers, or on a "
            "CPU with a core free for the copy thread, modules when layers overflow its cache)",
        },
    ),
)
FLAG_DESTS = tuple(dest for _, dest, _ in _FLAGS)
FLAG_NAMES = {dest: flag for flag, dest, _ in _FLAGS}  # dest -> its flag, e.g. "--cpu-offload-gb"


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add vLLM's weight-offloading flags to `parser` (every default is "not given")."""
    group = parser.add_argument_group("weight offloading (vLLM-compatible)")
    for flag, dest, keywords in _FLAGS:
        group.add_argument(flag, dest=dest, default=None, **keywords)
    return parser


def parse_flags(argv: Sequence[str]) -> argparse.Namespace:
    """Parse the offload flags alone; a bad flag raises `ConfigError`."""
    parser = _RaisingParser(prog="offload", add_help=False)
    add_cli_args(parser)
    return parser.parse_args(list(argv))


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The offload flags given in `args` (parsed by a parser `add_cli_args` extended),
    as flat config keys."""
    return {
        dest: getattr(args, dest) for dest in FLAG_DESTS if getattr(args, dest, None) is not None
    }
