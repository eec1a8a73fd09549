"""The engine core's decode turn with speculative decoding (`speculative`, `spec_tree`):
the running rows scored with the guesses that pay here (`Pace`) in one verify forward, or
a plain decode step where none do."""

from __future__ import annotations

import time
from collections.abc import Callable

from offload.engine.requests import Row
from offload.engine.spec_tree import Tree, walk
from offload.engine.speculative import Pace, guesses_for


class SpecTurn:
    """`core`'s (an `EngineCore`, not imported: it imports this) decode turns with
    `speculator`'s guesses, paced by `pace`; `on_verified(drafts, guessed, kept)` after
    each verify forward (the counters)."""

    def __init__(self, core, speculator, pace: Pace, on_verified: Callable):
        self.core, self.speculator, self.pace = core, speculator, pace
        self.on_verified = on_verified

    def __call__(self, rows: list[Row]) -> None:
        """A turn of `rows` scoring the guesses that pay here, or a plain step."""
        core = self.core
        start, before = time.perf_counter(), sum(len(row.sequence.tokens) for row in rows)
        depth = self.pace.guesses()
        guesses = guesses_for(self.speculator, rows, core.max_len, depth, core.runner.takes_trees)
        if guesses is None:
            core.decode(rows)
        else:
            self._verify(rows, guesses)
        tokens = sum(len(row.sequence.tokens) for row in rows) - before
        self.pace.record(depth if guesses else 0, tokens, time.perf_counter() - start)

    def _verify(self, rows: list[Row], trees: list[Tree]) -> None:
        """A verify forward of `rows` with their guesses' `trees`, and the tokens it
        gives: each row moves past the tokens it kept."""
        core = self.core
        logits = core.runner.verify(rows, trees)  # [rows, queries, vocab]
        before = [len(row.sequence.tokens) for row in rows]

        def choose(live, picking):
            return core.choose([rows[i] for i in live], picking)

        paths = walk(trees, rows, logits, choose)
        core.runner.keep_paths(rows, paths)
        for row, count in zip(rows, before, strict=True):
            row.column += len(row.sequence.tokens) - count
        drafts = sum(bool(len(tree)) for tree in trees)
        self.on_verified(drafts, sum(map(len, trees)), sum(map(len, paths)))
        core.emit(rows)
