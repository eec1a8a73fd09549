"""The `offload` command's start-up: wall time of --version, --help, each subcommand's
--help and a mistyped command, each a fresh process, against a bound of 1 s.

    python benchmarks/cli_latency.py [--repeats 5]

The README runs the console script (`offload ...`), so that is what is timed: the one
beside this Python, else `python -m offload.cli`. Each command runs once to warm the
page cache, then `--repeats` times; the figure is the median. Beside it: the exit status,
whether torch was imported (`-X importtime`, one more run), and for each subcommand's
--help, the value-taking flags whose help says no default.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common

from offload.cli import build_parser

BOUND_S = 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    prefix = _command_prefix()
    subcommands = _subcommands(build_parser())
    commands = [["--version"], ["--help"], ["generat"]]
    commands += [[name, "--help"] for name in subcommands]
    print(f"{' '.join(prefix)}: median of {args.repeats} fresh processes, bound {BOUND_S:.1f} s")
    results, failures = [], []
    for argv in commands:
        row = _measure(prefix, argv, args.repeats)
        problems = _check(argv, row, subcommands)
        row["problems"] = problems
        del row["stdout"]  # (the help texts: long, and in the source)
        failures += [f"{' '.join(argv)}: {p}" for p in problems]
        results.append(row)
        print(f"  offload {' '.join(argv):<16} {row['median_s']:6.3f} s (bound {BOUND_S:.1f} s)  "
              f"exit {row['exit_code']}  torch {'yes' if row['imports_torch'] else 'no '}  "
              f"{'; '.join(problems) or 'ok'}")  # fmt: skip
    print(
        "all within the bound and checks" if not failures else "FAILED:\n  " + "\n  ".join(failures)
    )
    payload = {"command": prefix, "repeats": args.repeats, "bound_s": BOUND_S,
               "results": results, "failures": failures}  # fmt: skip
    print(f"saved {common.save('cli-latency', torch.device('cpu'), payload)}")
    sys.exit(1 if failures else 0)


def _command_prefix() -> list[str]:
    script = Path(sys.executable).with_name("offload")
    return [str(script)] if script.exists() else [sys.executable, "-m", "offload.cli"]


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _measure(prefix: list[str], argv: list[str], repeats: int) -> dict[str, object]:
    env = {**os.environ, "COLUMNS": "100"}  # the same wrapping on every terminal
    times = []
    for _ in range(repeats + 1):  # the first warms the page cache and is not counted
        started = time.perf_counter()
        done = subprocess.run([*prefix, *argv], capture_output=True, text=True, env=env)
        times.append(time.perf_counter() - started)
    python = prefix if prefix[0] == sys.executable else [sys.executable, *prefix]
    traced = subprocess.run([python[0], "-X", "importtime", *python[1:], *argv],
                            capture_output=True, text=True, env=env)  # fmt: skip
    imported = {line.split("|")[-1].strip() for line in traced.stderr.splitlines()}
    return {
        "argv": argv,
        "median_s": statistics.median(times[1:]),
        "times_s": times[1:],
        "exit_code": done.returncode,
        "imports_torch": "torch" in imported,
        "imports_transformers": "transformers" in imported,
        "stdout": done.stdout,
        "stderr": done.stderr,
    }


def _check(argv: list[str], row: dict, subcommands: dict) -> list[str]:
    """What is wrong with the command's result besides its time."""
    problems = [f"{row['median_s']:.2f} s >= {BOUND_S} s"] if row["median_s"] >= BOUND_S else []
    if "Traceback" in row["stderr"]:
        problems.append("a traceback")
    if argv == ["generat"]:
        if row["exit_code"] == 0 or "did you mean 'generate'" not in row["stderr"]:
            problems.append(f"exit {row['exit_code']}, no did-you-mean: {row['stderr']!r}")
        return problems
    if row["exit_code"] != 0:
        problems.append(f"exit {row['exit_code']}")
    if argv[0] in subcommands:
        problems += [f"{flag}: no default shown" for flag in
                     undocumented_defaults(row["stdout"], subcommands[argv[0]])]  # fmt: skip
    return problems


def undocumented_defaults(help_text: str, parser: argparse.ArgumentParser) -> list[str]:
    """The flags in `help_text` that take a value but whose help never says "default".

    A switch (a flag with no value: --help, store_true, store_const) is off unless given,
    so it has nothing to show; every flag with a value has a default worth saying, be it
    argparse's "(default: X)" or, where the default is None, what leaving it out does."""
    missing = []
    for flags, text in _help_entries(help_text):
        action = parser._option_string_actions.get(flags[0])
        if action is not None and action.nargs != 0 and "default" not in text.lower():
            missing.append(flags[-1])
    return missing


def _help_entries(help_text: str) -> list[tuple[list[str], str]]:
    """Each option's entry in a --help text: its flags and its whole help, unwrapped."""
    entries: list[list] = []  # [flags, help so far]
    current = None
    for line in help_text.splitlines():
        if line.startswith("  -"):  # an option's first line
            head = line.strip().split("  ")[0]
            current = [[word.rstrip(",") for word in head.split() if word.startswith("-")], line]
            entries.append(current)
        elif line.startswith("   ") and current is not None:  # its help, continued
            current[1] += " " + line.strip()
        else:  # a blank line, a heading, a positional argument
            current = None
    return [(flags, text) for flags, text in entries]


if __name__ == "__main__":
    main()
