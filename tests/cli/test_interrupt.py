"""Ctrl-C in the `offload` command: one line and the shell's status for SIGINT; called
from Python, the KeyboardInterrupt is the caller's."""

import sys

import pytest

from offload import cli
from offload.cli import commands
from offload.llm import process_exit


def _interrupted(args):
    raise KeyboardInterrupt


def test_ctrl_c_is_one_line_and_status_130(monkeypatch, capsys):
    left: list[int] = []  # (the program ends the process with its status: recorded here)
    monkeypatch.setattr(process_exit, "leave_now", left.append)
    monkeypatch.setattr(commands, "generate", _interrupted)
    monkeypatch.setattr(sys, "argv", ["offload", "generate"])
    assert cli.main() == 130 and left == [130]
    captured = capsys.readouterr()
    assert captured.err == "offload: interrupted\n" and not captured.out


def test_ctrl_c_during_a_call_from_python_goes_on_to_the_caller(monkeypatch, capsys):
    """A status would swallow the caller's Ctrl-C: a test calling main(argv) passed it on
    as a failed assertion, and the test run went on."""
    monkeypatch.setattr(commands, "generate", _interrupted)
    with pytest.raises(KeyboardInterrupt):
        cli.main(["generate"])
    assert capsys.readouterr().err == ""
