"""The CLI reference (docs/cli.md) written from the parser: each command, what it is for,
and each flag with its default and help. `python -m offload.cli.reference > docs/cli.md`
writes it; tests/cli/test_reference.py checks that the file is what the parser says."""

from __future__ import annotations

import argparse
import re
import sys

from offload.cli.main import build_parser

COMMAND = "python -m offload.cli.reference > docs/cli.md"


def cli_reference(parser: argparse.ArgumentParser | None = None) -> str:
    """The reference as Markdown. A named flag group that several commands share (the
    offload flags) is written once, after the commands, and linked from each."""
    parser = parser or build_parser()
    commands = _subcommands(parser)
    purposes = {action.dest: action.help for action in commands._choices_actions}
    lines = [
        "# CLI reference",
        "",
        f"Generated from the parser by `{COMMAND}`: do not edit it by hand.",
        "",
        f"{parser.description} `offload --version` prints the version; "
        "`offload COMMAND --help` prints one command's flags.",
        "",
        "Commands: "
        + ", ".join(f"[{name}](#{_anchor('offload ' + name)})" for name in commands.choices),
    ]
    shared: dict[str, list[str]] = {}  # a named group's title -> its table
    for name, command in commands.choices.items():
        lines += _command(name, purposes[name], command, shared)
    for title, table in shared.items():
        lines += ["", f"## {title}", "", *table]
    return "\n".join(lines) + "\n"


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _command(
    name: str, purpose: str, command: argparse.ArgumentParser, shared: dict[str, list[str]]
) -> list[str]:
    positionals = " ".join(_usage(a) for a in command._actions if not a.option_strings)
    lines = ["", f"## offload {name}", "", f"{purpose[0].upper()}{purpose[1:]}.", ""]
    lines += [f"`offload {name} {positionals + ' ' if positionals else ''}[flags]`", ""]
    own = [a for a in command._actions if a.help != argparse.SUPPRESS and a.dest != "help"]
    named = []
    for group in command._action_groups:
        if group in (command._positionals, command._optionals) or not group._group_actions:
            continue
        table = _table(group._group_actions, command)
        if shared.setdefault(group.title, table) != table:  # (one title, one set of flags)
            raise AssertionError(f"{group.title!r} differs between commands")
        named.append(f"[{group.title}](#{_anchor(group.title)})")
        own = [a for a in own if a not in group._group_actions]
    lines += _table(own, command)
    if named:
        lines += ["", f"And the {', '.join(named)} flags."]
    return lines


def _table(actions: list[argparse.Action], command: argparse.ArgumentParser) -> list[str]:
    rows = ["| flag | default | what it does |", "|---|---|---|"]
    for action in actions:
        flag = _usage(action)
        cells = (f"`{flag}`", _default(action), _help(action, command))
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return rows


def _usage(action: argparse.Action) -> str:
    """`-q, --quantization QUANTIZATION`, `--batch-sizes N [N ...]`, `[path]`."""
    if action.choices is not None and action.metavar is None:
        metavar = "{" + ",".join(map(str, action.choices)) + "}"
    else:
        metavar = action.metavar or (action.dest.upper() if action.option_strings else action.dest)
    if action.nargs == 0:
        argument = ""
    elif action.nargs in ("+", "*"):
        argument = f"{metavar} [{metavar} ...]"
    elif action.nargs == "?" and not action.option_strings:
        return f"[{metavar}]"
    else:
        argument = metavar
    return " ".join(part for part in (", ".join(action.option_strings), argument) if part)


def _default(action: argparse.Action) -> str:
    """The parser's own default (shown where it is a value, not "not given" or "off")."""
    default = action.default
    if default in (None, argparse.SUPPRESS) or action.nargs == 0:
        return ""
    if isinstance(default, (list, tuple)):
        default = " ".join(map(str, default))
    return f"`{default}`"


def _help(action: argparse.Action, command: argparse.ArgumentParser) -> str:
    text = action.help or ""
    if "%" in text:  # argparse's own expansion, as --help shows it
        text = text % {**vars(action), "prog": command.prog}
    others = [
        other.option_strings[-1]
        for group in command._mutually_exclusive_groups
        if action in group._group_actions
        for other in group._group_actions
        if other is not action
    ]
    return text + (f" (not with {', '.join(others)})" if others else "")


def _anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


if __name__ == "__main__":  # python -m offload.cli.reference > docs/cli.md
    sys.stdout.write(cli_reference())
