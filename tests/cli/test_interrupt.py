"""Ctrl-C in the `offload` command: one line and the shell's status for SIGINT."""

from offload import cli
from offload.cli import commands


def test_ctrl_c_is_one_line_and_status_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "generate", interrupted)
    assert cli.main(["generate"]) == 130
    captured = capsys.readouterr()
    assert captured.err == "offload: interrupted\n" and not captured.out
