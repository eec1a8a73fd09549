"""The docs hold together, without running anything: every `offload ...` line of the user
guide and the troubleshooting page parses with the command's own parser (so a flag renamed
or removed fails here), their Python blocks compile, and every relative link in docs/*.md
names a file that exists (and, with `#anchor`, a heading or anchor in it)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from offload.cli.main import build_parser

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES_WITH_COMMANDS = ("guide.md", "troubleshooting.md")
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.M | re.S)
_SHELL_ENDS = {"&", "&&", "|", "||", ";", ">", ">>"}  # what ends the command in a line


def code_blocks(page: str, language: str) -> list[str]:
    text = (DOCS / page).read_text()
    return [body for lang, body in _FENCE.findall(text) if lang == language]


def offload_commands(page: str) -> list[str]:
    """Each line of the page's bash blocks that runs `offload`, its comment cut off."""
    return [
        line.strip()
        for block in code_blocks(page, "bash")
        for line in block.splitlines()
        if line.strip().startswith("offload ")
    ]


COMMANDS = [(page, line) for page in PAGES_WITH_COMMANDS for line in offload_commands(page)]


def test_the_guide_shows_commands():
    assert len(offload_commands("guide.md")) >= 20


@pytest.mark.parametrize(("page", "line"), COMMANDS, ids=[line for _, line in COMMANDS])
def test_each_offload_command_in_the_docs_parses(page, line, capsys):
    words = shlex.split(line, comments=True)
    argv = words[1 : next((i for i, w in enumerate(words) if w in _SHELL_ENDS), len(words))]
    try:
        build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"docs/{page}: {line!r} does not parse: {capsys.readouterr().err.strip()}")


@pytest.mark.parametrize("page", PAGES_WITH_COMMANDS)
def test_python_blocks_in_the_docs_compile(page):
    for number, block in enumerate(code_blocks(page, "python"), 1):
        compile(block, f"docs/{page}, Python block {number}", "exec")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file: GitHub's for its headings (lower case, punctuation
    dropped, spaces as dashes, a repeated one numbered) and those of `<a id="...">`."""
    text = _FENCE.sub("", path.read_text())
    found: set[str] = set(re.findall(r'<a (?:id|name)="([^"]+)"', text))
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        number = 0
        while (f"{slug}-{number}" if number else slug) in found:
            number += 1
        found.add(f"{slug}-{number}" if number else slug)
    return found


def relative_links(path: Path) -> list[str]:
    """The targets of the page's Markdown links and images that are not web addresses."""
    text = _FENCE.sub("", path.read_text())
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


PAGES = [*sorted(DOCS.glob("*.md")), DOCS.parent / "README.md"]


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_relative_links_in_the_docs_point_to_what_exists(path):
    for target in relative_links(path):
        name, _, anchor = target.partition("#")
        linked = (path.parent / name).resolve() if name else path
        assert linked.exists(), f"{path.name}: {target} names no file"
        if anchor and linked.suffix == ".md":
            assert anchor in anchors(linked), f"{path.name}: {target} names no anchor"
