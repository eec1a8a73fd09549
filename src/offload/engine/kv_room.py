"""The scheduler's KV room (`Scheduler` is a `KVRoom`): preemption, as vLLM V1's recompute.

With a KV room (`room`, in columns: where the rows' memory is taken only as they write,
a CPU's), there are more rows than the room holds at full length, as vLLM's paged cache
admits more sequences than it could finish at once. The scheduler counts the columns
each row may hold memory for (`committed`, in pages), gives back what a row no longer
needs (`Keep`), admits a request only where its prompt (and what it decoded) fits, and
before each decode step makes room for every running row's next column: held prefixes go
first (least recently used), then the youngest request is preempted (vLLM V1's
recompute): its rows are given back, it waits at the front of the queue, and once
admitted again its prompt is prefilled as before and its tokens so far are fed back
through decode steps among the running rows (`Row.replaying`) without being sampled
again. Its keys and values are then computed as they were the first time (a decode step
each), so its answer is what it would have been; a prefill of them would round otherwise.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from offload.engine.prefixes import BLOCK, PrefixRows
from offload.engine.requests import Group, Row, Submitted
from offload.errors import ConfigError


class Move(NamedTuple):
    """Row `source`'s first `columns` columns copied into row `target`."""

    source: int
    target: int
    columns: int


class Keep(NamedTuple):
    """Row `row` keeps its first `columns` columns; the memory of the rest goes back."""

    row: int
    columns: int


Moves = list[Move | Keep]  # what the cache does, in order, before the next forward


class KVRoom:
    """The room's part of a `Scheduler`, over its rows, group, queue and prefixes."""

    room: int | None  # positions all rows may hold together (None: each row its length)
    page: int  # columns of a page: memory is taken and given back so many at once
    committed: list[int]  # columns of each row that may hold memory
    num_preemptions: int
    max_rows: int
    running: list[Row]
    group: Group | None
    waiting: deque[Submitted]
    prefixes: PrefixRows | None

    def make_room(self) -> Moves:
        """Before a decode step, with a KV room: room for each running row's next column,
        made by giving back what rows no longer need, then held prefixes (least recently
        used first), then by preempting the youngest requests (the one being prefilled
        first); what the cache must do (memory given back). A request alone always fits
        (`check_fits`), so the oldest running one is never preempted."""
        moves: Moves = []
        if self.room is None:
            return moves
        self._trim(moves)
        while self._projected() > self.room:
            if not (self._evict(moves) or self._preempt_group(moves) or self._preempt(moves)):
                break
        for index, row in enumerate(self.running):  # (a finished row rewrites its column)
            self.committed[index] = max(self.committed[index], row.column + 1)
        return moves

    def check_fits(self, request: Submitted) -> None:
        """That `request`'s sequences, each as long as it may grow, fit the KV room
        together (else preemption could never make room for it)."""
        if self.room is None:
            return
        longest = [len(s.prompt_ids) + s.limit + 1 for s in request.sequences]
        if sum(self._pages(length) for length in longest) > self.room:
            raise ConfigError(
                f"{len(longest)} sequence(s) of up to {max(longest) - 1} positions need more "
                f"KV cache than the room holds ({self.room} positions in all); lower "
                "max_tokens or n, or give the KV cache more memory"
            )

    def released(self, keep: list[int] | None) -> None:
        """The cache gave back all but each row's first `keep[row]` columns (None: all)."""
        self.committed = [keep[row] if keep else 0 for row in range(self.max_rows)]

    @property
    def kv_usage(self) -> float:
        """The part of the KV room the rows hold memory for (0 without a room)."""
        if not self.room:
            return 0.0
        return min(sum(self._pages(c) for c in self.committed) / self.room, 1.0)

    def _move(self, moves: Moves, source: int, target: int, columns: int) -> None:
        moves.append(Move(source, target, columns))
        self.committed[target] = max(self.committed[target], columns)

    def _pages(self, columns: int) -> int:
        return row_pages(columns, self.page)

    def _needs(self, row: int) -> int:
        """The columns row `row` will hold by the end of the coming decode step: a
        running row's next column, a group's whole prompt (and a preempted request's
        tokens), a free row what it holds now."""
        if row < len(self.running):
            return max(self.committed[row], self.running[row].column + 1)
        group = self.group
        if group is not None and group.first <= row < group.first + len(group.rows):
            sequence = group.rows[row - group.first].sequence
            return max(self.committed[row], group.width + len(sequence.tokens) + 1)
        return self.committed[row]

    def _projected(self) -> int:
        return sum(self._pages(self._needs(row)) for row in range(self.max_rows))

    def _holds(self, row: int, columns: int) -> bool:
        """Whether free row `row` may take `columns` more within the room."""
        if self.room is None:
            return True
        grown = self._pages(max(self.committed[row], columns)) - self._pages(self.committed[row])
        return self._projected() + grown <= self.room - len(self.running)

    def _expected(self, row: int) -> int:
        """The columns row `row` holds that anything will read: a running row's, a
        group's prefilled prompt, a held prefix."""
        if row < len(self.running):
            return self.running[row].column + 1
        group = self.group
        if group is not None and group.first <= row < group.first + len(group.rows):
            return group.done_columns if row == group.first else 0
        return len(self.prefixes.tokens[row]) if self.prefixes is not None else 0

    def _trim(self, moves: Moves) -> None:
        """Each row's memory past what anything reads given back (a finished answer, a
        row moved out, a prefix evicted)."""
        if self.room is None:
            return
        for row in range(self.max_rows):
            expected = self._expected(row)
            if self._pages(self.committed[row]) > self._pages(expected):
                moves.append(Keep(row, expected))
                self.committed[row] = expected

    def _room_for(self, request: Submitted, moves: Moves) -> bool:
        """Whether `request`'s rows fit the room beside the running ones (and one more
        column each of theirs), held prefixes given back as needed: least recently used
        first, those its prompt begins with last, and none unless that makes it fit."""
        if self.room is None:
            return True
        need = sum(self._pages(len(s.prompt_ids) + len(s.tokens) + 1) for s in request.sequences)
        limit = self.room - len(self.running) - need
        if self._projected() <= limit:
            return True
        held = self._held_rows()
        if self._projected() - sum(self._pages(self.committed[row]) for row in held) > limit:
            return False
        assert self.prefixes is not None
        prompt = request.prompt_ids
        own = {row for row in held if _begins(prompt, self.prefixes.tokens[row])}
        while self._projected() > limit:
            if not self._evict(moves, keep=own):
                return False
        return True

    def _held_rows(self) -> list[int]:
        """The free rows holding a prefix (none running or being prefilled)."""
        if self.prefixes is None:
            return []
        busy = len(self.running) + (len(self.group.rows) if self.group is not None else 0)
        return [row for row in range(busy, self.max_rows) if self.prefixes.tokens[row]]

    def _evict(self, moves: Moves, keep: set[int] = frozenset()) -> bool:
        """The least recently used held prefix given back (those in `keep` last); False
        if no row holds one."""
        held = self._held_rows()
        if not held:
            return False
        assert self.prefixes is not None
        row = self.prefixes.victim([r for r in held if r not in keep] or held, set())
        assert row is not None
        self.prefixes.clear(row)
        self._trim(moves)
        return True

    def _preempt_group(self, moves: Moves) -> bool:
        """The request being prefilled (the youngest) back to the front of the queue;
        its prompt's columns so far stay held, where prefix caching is on."""
        group = self.group
        if group is None:
            return False
        self.group = None
        if self.prefixes is not None and not group.every_position:
            self.prefixes.hold(group.first, group.rows[0].prompt_ids[: group.done_columns])
        self._requeue(group.rows[0].request, moves)
        return True

    def _preempt(self, moves: Moves) -> bool:
        """The youngest running request (its rows are the last ones) back to the front of
        the queue, its prompts' columns held where prefix caching is on; False where it
        is the only one."""
        if not self.running:
            return False
        youngest = self.running[-1].request
        first = next(i for i, row in enumerate(self.running) if row.request is youngest)
        if first == 0:
            return False
        rows = self.running[first:]
        del self.running[first:]
        for index, row in enumerate(rows, start=first):
            sequence = row.sequence
            sequence.exact_tokens = max(0, min(row.exact, row.column) - len(sequence.prompt_ids))
            if self.prefixes is not None:
                self.prefixes.hold(index, prompt_written(row), len(row.prompt_ids))
        if any(row.is_live for row in rows):
            self._requeue(youngest, moves)
        else:
            self._trim(moves)
        return True

    def _requeue(self, request: Submitted, moves: Moves) -> None:
        request.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self._trim(moves)


def row_pages(columns: int, page: int) -> int:
    """The columns of memory a row holding `columns` takes, in pages of `page` columns:
    whole pages, and one more (each head's columns start anywhere in a page)."""
    if columns <= 0:
        return 0
    return (-(-columns // page) + 1) * page


def _begins(prompt: list[int], held: list[int]) -> bool:
    """Whether `prompt` begins with a whole block of what a row holds."""
    return len(held) >= BLOCK and prompt[:BLOCK] == held[:BLOCK]


def prompt_written(row: Row) -> list[int]:
    """The tokens of row `row` that prefix caching may reuse: those whose columns have the
    bits a prefill gives them (`Row.exact`): its prompt's, and its answer's where each
    decode step took the prefill's attention kernel (a CPU's: `prompt_attention`). Not
    otherwise: ATen's attention of a decode step rounds otherwise than a prefill (measured
    on the default model: one of four second chat turns then changed its answer from its
    17th token on), as does a speculative verify forward. Nothing where its request
    failed: a forward that failed may have written part of a column."""
    if row.request.failed:
        return []
    sequence = row.sequence
    return (sequence.prompt_ids + sequence.tokens)[: min(row.exact, row.column)]
