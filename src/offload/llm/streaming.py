"""Text shown as it is generated: only what the final text is sure to begin with.

The text of a sequence is its tokens decoded so far. Three things can still change its
end, so they are held back until the next token settles them: characters that might be
the start of a stop string (the final text ends before a stop string), an incomplete
UTF-8 character (decoded as U+FFFD until its last byte comes) and trailing whitespace
(a tokenizer's clean-up may merge it with what follows).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def settled(text: str, stop_strings: Sequence[str]) -> str:
    """The longest prefix of `text` that no later token can change."""
    end = len(text)
    for stop in stop_strings:  # a suffix that a stop string may continue
        for length in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:length]):
                end = min(end, len(text) - length)
                break
    kept = text[:end]
    return kept.rstrip().rstrip("\ufffd").rstrip()


class TextStream:
    """Writes one sequence's text as it grows; `finish` writes the rest of the final text."""

    def __init__(self, write: Callable[[str], None], stop_strings: Sequence[str] = ()):
        self._write = write
        self._stop_strings = tuple(stop_strings)
        self.shown = ""

    def update(self, text: str) -> None:
        ready = settled(text, self._stop_strings)
        if len(ready) > len(self.shown) and ready.startswith(self.shown):
            self._write(ready[len(self.shown) :])
            self.shown = ready

    def finish(self, final_text: str) -> None:
        if not final_text.startswith(self.shown):  # cannot happen if `settled` is right
            raise AssertionError(f"streamed {self.shown!r}, but the text is {final_text!r}")
        self._write(final_text[len(self.shown) :])
        self.shown = final_text
