"""The engine core's scheduler: which requests wait, which run in which rows of the KV
cache, and what each turn computes. Plain Python, no tensors: the step runner does the
forwards it decides.

A turn (`EngineCore.step`): cancelled requests leave; then, while the turn's
`max_num_batched_tokens` last, the request being prefilled gets its next chunk (chunks cut
from the prompt's start, so the same whatever else runs), or (none being prefilled) the running rows are packed to the front and the first waiting request
is admitted into the free rows after them, its prompt at column 0 of each of its `n` rows
(prefilled in the first, copied to the others);
then every running row decodes one token. Requests admitted in one turn decode together
from the next step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from offload.engine.requests import Group, Row, Submitted


class Scheduler:
    """Waiting requests, running rows [0, len(running)) and the group being prefilled,
    for a cache of `max_rows` rows."""

    def __init__(self, max_rows: int, max_num_batched_tokens: int | None = None):
        self.max_rows = max_rows
        self.chunk_tokens = max_num_batched_tokens
        self.waiting: deque[Submitted] = deque()
        self.running: list[Row] = []  # rows [0, len)
        self.group: Group | None = None  # being prefilled, in the rows after `running`
        self.turn_tokens: int | None = None  # prefill tokens left this turn (None: any)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.group)

    @property
    def num_running(self) -> int:
        return len({id(r.request) for r in self.running if r.is_live})

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + (self.group is not None)

    def add(self, requests: Iterable[Submitted]) -> None:
        self.waiting.extend(requests)

    def begin_turn(self) -> None:
        """Drop cancelled requests (a running one's rows finish as "abort") and refill the
        turn's prefill budget."""
        self.waiting = deque(r for r in self.waiting if not r.cancelled)
        for row in self.running + self.group_rows():
            if row.request.cancelled and row.sequence.finish_reason is None:
                row.sequence.finish_reason = "abort"
        self.turn_tokens = self.chunk_tokens

    def group_rows(self) -> list[Row]:
        return self.group.rows if self.group is not None else []

    def next_group(self) -> tuple[Group | None, list[tuple[int, int, int]]]:
        """The group to prefill next this turn, or None (the budget is spent, or nothing
        waits that fits): the one being prefilled, else the first waiting request admitted
        after packing the running rows; and the packing's row moves (source, target,
        columns) that the cache must make first. A chunk runs whole or waits for the next
        turn (the turn's first always runs), so that where a prompt's chunks end depends
        on the prompt alone, not on what was prefilled before it."""
        moves = []
        if self.group is None:
            moves = self._pack()
            self.group = self._admit()
        group, budget = self.group, self.turn_tokens
        if group is None or budget is None:
            return group, moves
        started = budget < self.chunk_tokens  # (something was prefilled this turn)
        if started and budget < min(self.chunk_tokens, group.width - group.done_columns):
            return None, moves
        return group, moves

    def next_chunk(self, group: Group) -> tuple[int, int]:
        """The columns [start, end) of `group`'s prompt that this forward prefills: the
        rest, or `max_num_batched_tokens` of them (one row computes them: the request's
        other rows copy its prompt once it is whole)."""
        step = group.width if self.chunk_tokens is None else self.chunk_tokens
        start, end = group.done_columns, min(group.done_columns + step, group.width)
        if self.turn_tokens is not None:
            self.turn_tokens -= end - start
        return start, end

    def prefilled(self, group: Group, end: int) -> bool:
        """Columns up to `end` of `group` are in the cache; True once its whole prompt is
        (its rows then run, and the next group may be admitted this turn)."""
        group.done_columns = end
        if end < group.width:
            return False
        self.group = None
        self.running.extend(group.rows)
        return True

    def drop_group(self) -> None:
        """The group's prefill failed (its requests are failed by the caller)."""
        self.group = None

    def decoding(self) -> list[Row]:
        """The rows of this turn's decode step: every running row, finished ones too
        while they hold their place (none if no row is live)."""
        return self.running if any(row.is_live for row in self.running) else []

    def pending(self) -> list[Submitted]:
        """Every request not yet done, once each: waiting, being prefilled or running."""
        found = list(self.waiting) + [row.request for row in self.running + self.group_rows()]
        return list({id(r): r for r in found}.values())

    def clear(self) -> None:
        self.waiting.clear()
        self.running, self.group = [], None

    def _pack(self) -> list[tuple[int, int, int]]:
        """Running rows move into the rows of finished ones: they stay at the front."""
        keep = [row for row in self.running if row.is_live]
        moves = []
        for target, row in enumerate(keep):
            source = self.running.index(row)
            if source != target:
                moves.append((source, target, row.column))
        self.running = keep
        return moves

    def _admit(self) -> Group | None:
        """The first waiting request into the free rows, its prompt at column 0, to be
        prefilled alone: prompts prefilled together are padded to one width, which moves
        a prompt's logits. (`check_fits` saw that it fits a row.)"""
        if not self.waiting:
            return None
        if len(self.waiting[0].sequences) > self.max_rows - len(self.running):
            return None
        request = self.waiting.popleft()
        width = len(request.prompt_ids)
        rows = [Row(request, sequence, 0, width) for sequence in request.sequences]
        return Group(len(self.running), rows, width)
