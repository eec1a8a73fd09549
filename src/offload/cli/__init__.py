"""The `offload` command: `generate`, `inspect`, `plan` and `bench` (`main.py` parses,
`commands.py`, `plan.py` and `demo.py` do the work)."""

from offload.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
