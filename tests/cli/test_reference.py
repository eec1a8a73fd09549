"""docs/cli.md is the parser's: regenerated in memory, it equals the committed file, so a
flag added, renamed or re-documented without regenerating it fails here."""

from pathlib import Path

from offload.cli.reference import COMMAND, cli_reference

CLI_MD = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_docs_cli_md_is_generated_from_the_parser():
    assert CLI_MD.read_text() == cli_reference(), f"docs/cli.md is out of date: run {COMMAND}"


def test_the_reference_names_every_command_and_flag():
    from offload.cli.main import build_parser

    text = cli_reference()
    commands = next(a for a in build_parser()._actions if a.choices and a.dest == "command")
    for name, command in commands.choices.items():
        assert f"## offload {name}\n" in text
        for action in command._actions:
            for flag in action.option_strings if action.dest != "help" else ():
                assert f"`{flag}" in text or f", {flag}" in text, (name, flag)
