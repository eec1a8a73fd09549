"""`offload generate` on a CPU decodes a short answer eagerly (no compiled step loaded or
compiled beside it: the load alone costs more than the steps it would save) and a long one
with its compiled step, as before."""

from __future__ import annotations

import pytest

from offload.cli import commands
from offload.cli.main import main


class _Made(Exception):
    """Raised by the stand-in `llm_of`: the `LLM` keywords the command chose."""


def _chosen(monkeypatch, argv: list[str]) -> dict:
    def made(args, spec, config, **more):
        raise _Made(more)

    monkeypatch.setattr(commands, "llm_of", made)
    with pytest.raises(_Made) as caught:
        main(["generate", "--no-progress", "--device", "cpu", *argv])
    return caught.value.args[0]


@pytest.mark.parametrize(
    ("argv", "eager"),
    [
        ([], True),  # (the default 64 tokens)
        (["--max-tokens", str(commands.EAGER_STEPS - 1)], True),
        (["--max-tokens", str(commands.EAGER_STEPS)], False),
        (["--max-tokens", "8", "--enforce-eager"], True),
    ],
)
def test_the_decode_is_eager_for_an_answer_of_few_steps(smollm2_path, monkeypatch, argv, eager):
    assert _chosen(monkeypatch, argv)["enforce_eager"] is eager
