"""Automatic prefix caching (vLLM's `enable_prefix_caching`) over the engine's rows: which
tokens' keys and values each row of the KV cache holds, so that a new request whose prompt
begins as a held sequence does copy those columns into its row instead of computing them.

There is no separate block pool: the rows are the cache. A running row holds its prompt
(and more as it decodes); a row whose sequence finished keeps what it wrote until the row
is needed again, and its content moves to a free row when packing would overwrite it.
Which free row gives way is chosen least recently used, rows holding nothing first, then
rows holding a copy of what another row holds. The rows' memory is already within the KV
room, so caching costs no memory; it costs a copy of the columns moved.

Rows are found by blocks of `BLOCK` tokens, as vLLM's (16), each named by a hash of the
whole prefix it ends (so one dict lookup per block finds the longest held prefix); the
match is then checked token for token (a hash collision can never reuse other keys). Past
the last whole block a match goes on only to the end of a held prompt that the new one
begins with whole (a chat's next turn reuses all of the last turn's prompt): carried on
token by token to wherever two unrelated prompts part, a match's length depended on which
prompts the rows held, and the greedy answers of 8 and 16 concurrent chats of the default
model then changed with the order they came in (measured: 1 of 8, 2 of 16; with whole
blocks only, none).
A request keeps at least its last prompt token to compute (its logits come from it).

Plain Python, no tensors: the scheduler turns its answers into row moves.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

BLOCK = 16  # tokens per block (vLLM's default block_size)


class PrefixRows:
    """What each of `max_rows` rows holds: token ids whose keys and values are in its
    columns [0, len)."""

    def __init__(self, max_rows: int):
        self.tokens: list[list[int]] = [[] for _ in range(max_rows)]
        self._hashes: list[list[int]] = [[] for _ in range(max_rows)]
        self._ends: list[tuple[int, ...]] = [() for _ in range(max_rows)]  # (see `hold`)
        self._index: dict[int, set[int]] = {}  # block hash -> rows holding that prefix
        self._used = [0] * max_rows  # when each row's content was last made or read
        self._clock = itertools.count(1)
        self.queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # of them found held (vLLM's prefix_cache_hits)

    def hold(self, row: int, tokens: list[int], prompt_end: int = 0) -> None:
        """Row `row` now holds `tokens` (what it held before is gone): a prompt's, and
        where `prompt_end` is given, the answer it was followed by past that. A match past
        the last whole block may end at either end (a chat's next turn begins with the
        whole of the last, a request sent again with its prompt)."""
        self.clear(row)
        self.tokens[row] = list(tokens)
        self._ends[row] = tuple(
            {len(tokens), *([prompt_end] if 0 < prompt_end < len(tokens) else [])}
        )
        hashes = block_hashes(tokens)
        self._hashes[row] = hashes
        for value in hashes:
            self._index.setdefault(value, set()).add(row)
        self._used[row] = next(self._clock)

    def clear(self, row: int) -> None:
        for value in self._hashes[row]:
            rows = self._index[value]
            rows.discard(row)
            if not rows:
                del self._index[value]
        self.tokens[row], self._hashes[row], self._ends[row] = [], [], ()

    def clear_all(self) -> None:
        for row in range(len(self.tokens)):
            self.clear(row)

    def copy(self, source: int, target: int, num_columns: int) -> None:
        """Row `source`'s first `num_columns` columns were copied into row `target`."""
        ends = [end for end in self._ends[source] if end < num_columns]
        self.hold(target, self.tokens[source][:num_columns], max(ends, default=0))

    def held_blocks(self, hashes: list[int]) -> tuple[set[int] | None, int]:
        """The rows holding the longest run of a prompt's first blocks (`hashes`, its
        `block_hashes`), and that run's tokens (None and 0: none), not counted as a query:
        what `lookup` first finds."""
        rows, length = None, 0
        for blocks, value in enumerate(hashes, start=1):
            if value not in self._index:
                break
            rows, length = self._index[value], blocks * BLOCK  # (they hold every block before)
        return rows, length

    def lookup(self, prompt: list[int]) -> tuple[int | None, int]:
        """A row holding the longest prefix of `prompt` of a whole block or more, at most
        all but its last token, and that prefix's length (0 and None: none), counted."""
        self.queries += len(prompt)
        rows, length = self.held_blocks(block_hashes(prompt[: len(prompt) - 1]))
        if rows is None:
            return None, 0
        row = max(rows, key=self._used.__getitem__)  # (the latest made or read of them)
        held = self.tokens[row]
        if held[:length] != prompt[:length]:  # (a hash collision: the tokens decide)
            same = next(i for i in range(length) if held[i] != prompt[i])
            length = same // BLOCK * BLOCK
            if not length:
                return None, 0
        else:  # (on to the end of a held prompt or answer the new one begins with, if any)
            for other in rows:
                held = self.tokens[other]
                for end in self._ends[other]:
                    if length < end < len(prompt) and prompt[:end] == held[:end]:
                        row, length = other, end
        self.hits += length
        self._used[row] = next(self._clock)
        return row, length

    def is_spare(self, row: int) -> bool:
        """Whether losing row `row`'s content loses nothing: it holds less than a block, or
        another row holds all it does."""
        hashes = self._hashes[row]
        return not hashes or len(self._index[hashes[-1]]) > 1

    def worth_moving(self, row: int, target: int) -> bool:
        """Whether row `row`'s content is worth more than row `target`'s (which it would
        replace)."""
        if self.is_spare(row):
            return False
        return self.is_spare(target) or self._used[target] < self._used[row]

    def victim(self, rows: Iterable[int], keep: set[int]) -> int | None:
        """The row of `rows` (not in `keep`) whose content is worth least: empty or held
        elsewhere first, then the least recently used."""
        candidates = [row for row in rows if row not in keep]
        if not candidates:
            return None
        return min(candidates, key=lambda row: (not self.is_spare(row), self._used[row]))


def block_hashes(tokens: list[int]) -> list[int]:
    """One hash per whole block of `tokens`, each of the whole prefix it ends."""
    hashes, previous = [], 0
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        previous = hash((previous, tuple(tokens[start : start + BLOCK])))
        hashes.append(previous)
    return hashes
