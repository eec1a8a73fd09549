"""The engine core's scheduler: which requests wait, which run in which rows of the KV
cache, and what each turn computes. Plain Python, no tensors: the step runner does the
forwards it decides.

A turn (`EngineCore.step`): cancelled requests leave; then, while the turn's
`max_num_batched_tokens` last, the request being prefilled gets its next chunk (chunks cut
from the prompt's start, so the same whatever else runs), or (none being prefilled) the
running rows are packed to the front and the first waiting request is admitted into the
free rows after them, its prompt at column 0 of each of its `n` rows (prefilled in the
first, copied to the others); then every running row decodes one token. Requests admitted
in one turn decode together from the next step; those whose prompts end in that turn may
be prefilled in one forward (`EngineCore._turn`): admitted first (`prefilled` with
`computed=False`), computed after, and held for prefix caching only then. With chunked
prefill while rows decode, the core runs the turn's one chunk inside the decode step
(`EngineCore._turn`, `mixed_step`).

With prefix caching (`prefixes.PrefixRows`), an admitted request whose prompt begins as
some row holds has those columns copied into its row and prefills only the rest; packing
and admission first move content worth keeping out of the rows they overwrite.

With a KV room (`kv_room.KVRoom`), more rows run than it holds at full length, and
the youngest request is preempted where they outgrow it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from offload.engine.kv_room import KVRoom, Moves, prompt_written
from offload.engine.prefixes import BLOCK, PrefixRows, block_hashes
from offload.engine.requests import Group, Row, Submitted

# Prompt tokens worth a forward of their own: a request whose prompt shares this many more
# with a prompt not yet computed than with the rows' waits for that prompt's forward, so
# that it reuses its prefix (see `_waits_for_unheld`).
SHARED = 32


class Scheduler(KVRoom):
    """Waiting requests, running rows [0, len(running)) and the group being prefilled,
    for a cache of `max_rows` rows."""

    def __init__(
        self,
        max_rows: int,
        max_num_batched_tokens: int | None = None,
        prefix_caching=False,
        room: int | None = None,
        page: int = 1,
    ):
        self.max_rows = max_rows
        self.prefixes = PrefixRows(max_rows) if prefix_caching else None
        # (`room`: the columns of keys and values all rows may hold together, None: each
        # row has its whole length; memory is taken and given back `page` columns at once)
        self.room, self.page = room, page
        self.committed = [0] * max_rows  # columns of each row that may hold memory
        self.num_preemptions = 0
        self.chunk_tokens = max_num_batched_tokens
        self.waiting: deque[Submitted] = deque()
        self.running: list[Row] = []  # rows [0, len)
        self.group: Group | None = None  # being prefilled, in the rows after `running`
        # Admitted whole and running, their prompts' forward not yet run (`prefilled` with
        # `computed=False`): their prefixes are held once it has (`computed`).
        self.unheld: list[Group] = []
        self._unheld_blocks: set[int] = set()  # (their prompts' block hashes)
        self.turn_tokens: int | None = None  # prefill tokens left this turn (None: any)
        self._turn_budget: int | None = None  # ... at the turn's start

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

    def begin_turn(self, paced: int | None = None) -> None:
        """Drop cancelled requests (a running one's rows finish as "abort") and refill the
        turn's prefill budget: `max_num_batched_tokens`, else `paced` (None: whole
        prompts; a number: this turn's tokens, the last prompt cut where they end)."""
        self.waiting = deque(r for r in self.waiting if not r.cancelled)
        for row in self.running + self.group_rows():
            if row.request.cancelled and row.sequence.finish_reason is None:
                row.sequence.finish_reason = "abort"
        self.turn_tokens = self.chunk_tokens if self.chunk_tokens is not None else paced
        self._turn_budget = self.turn_tokens

    def group_rows(self) -> list[Row]:
        return self.group.rows if self.group is not None else []

    def next_group(self) -> tuple[Group | None, Moves]:
        """The group to prefill next this turn, or None (the budget is spent, or nothing
        waits that fits): the one being prefilled, else the first waiting request admitted
        after packing the running rows; and what the cache must do first (the packing's
        row moves, memory given back). A chunk runs whole or waits for the next turn (the
        turn's first always runs), so that where a prompt's chunks end depends on the
        prompt alone, not on what was prefilled before it."""
        moves: Moves = []
        if self.group is None:
            # (not while `unheld` prompts wait for their forward: their rows stay put, and
            # a request that finds no free row waits for it)
            moves = self._pack() if not self.unheld else []
            self._trim(moves)
            self.group = self._admit(moves)
            self._trim(moves)
        group, budget = self.group, self.turn_tokens
        if group is None or budget is None:
            return group, moves
        started = budget < self._turn_budget  # (something was prefilled this turn)
        unit = self.chunk_tokens or 1  # (a paced turn cuts its last prompt anywhere)
        if started and budget < min(unit, group.width - group.done_columns):
            return None, moves
        return group, moves

    def next_chunk(self, group: Group) -> tuple[int, int]:
        """The columns [start, end) of `group`'s prompt that this forward prefills: the
        rest, or `max_num_batched_tokens` of them, or what a paced turn has left (one row
        computes them: the request's other rows copy its prompt once it is whole)."""
        step = self.chunk_tokens or self.turn_tokens or group.width
        start, end = group.done_columns, min(group.done_columns + step, group.width)
        if self.turn_tokens is not None:
            self.turn_tokens -= end - start
        return start, end

    def prefilled(self, group: Group, end: int, computed: bool = True) -> bool:
        """Columns up to `end` of `group` are in the cache; True once its whole prompt is
        (its rows then run, and the next group may be admitted this turn). `computed`
        False: they will be once a forward of several prompts runs (`computed`), and no
        row holds its prompt for prefix caching until then."""
        group.done_columns = end
        self.committed[group.first] = max(self.committed[group.first], end)
        if end < group.width:
            return False
        self.group = None
        for index in range(1, len(group.rows)):  # (the others copy the first row's prompt)
            row = group.first + index
            self.committed[row] = max(self.committed[row], group.width)
        if computed:
            self._hold(group)
        else:
            self.unheld.append(group)
            self._unheld_blocks.update(block_hashes(group.rows[0].prompt_ids))
        self.running.extend(group.rows)
        return True

    def computed(self, done: bool = True) -> None:
        """The forward of the `unheld` groups' prompts ran (`done`: their rows hold their
        prompts; else it failed, and their requests with it)."""
        for group in self.unheld if done else ():
            self._hold(group)
        self.unheld.clear()
        self._unheld_blocks.clear()

    def _hold(self, group: Group) -> None:
        if self.prefixes is not None:
            for index, row in enumerate(group.rows):
                self.prefixes.hold(group.first + index, row.prompt_ids)

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
        self.computed(done=False)
        self.forget_prefixes()

    def held_columns(self) -> list[int] | None:
        """The columns of each row that prefix caching holds (None: it is off)."""
        if self.prefixes is None:
            return None
        return [len(tokens) for tokens in self.prefixes.tokens]

    def forget_prefixes(self) -> None:
        """No row holds anything any more (their memory was given back)."""
        if self.prefixes is not None:
            self.prefixes.clear_all()

    def _pack(self) -> Moves:
        """Running rows move into the rows of finished ones: they stay at the front. With
        prefix caching, a finished row about to be overwritten first moves to a free row
        (where the room holds it)."""
        keep = [row for row in self.running if row.is_live]
        sources = [index for index, row in enumerate(self.running) if row.is_live]
        moves: Moves = []
        prefixes = self.prefixes
        if prefixes is not None:
            taken: set[int] = set()
            free = range(len(self.running), self.max_rows)
            for index, row in enumerate(self.running):
                if row.is_live:
                    continue
                prefixes.hold(index, prompt_written(row), len(row.prompt_ids))
                if index < len(keep) and not prefixes.is_spare(index):
                    target = prefixes.victim(free, taken)
                    if self._save(moves, index, target):
                        taken.add(target)
        for target, (source, row) in enumerate(zip(sources, keep, strict=True)):
            if source != target:
                self._move(moves, source, target, row.column)
                if prefixes is not None:  # (the source row keeps a copy)
                    prefixes.hold(source, prompt_written(row), len(row.prompt_ids))
                    prefixes.copy(source, target, row.column)
        self.running = keep
        return moves

    def _admit(self, moves: Moves) -> Group | None:
        """The first waiting request into the free rows, its prompt at column 0 of its own
        rows (prompts prefilled in one forward are packed, never padded to one width,
        which would move a prompt's logits). (`check_fits` saw that it fits a row.) With
        prefix caching, the longest prefix of its prompt some row holds is copied into its
        first row first (added to `moves`), and only the rest is prefilled. With a KV room,
        only where its rows fit it (held prefixes given back to make room); a preempted
        request (`resumed`) needs room for the tokens it decoded too."""
        if not self.waiting:
            return None
        if len(self.waiting[0].sequences) > self.max_rows - len(self.running):
            return None
        if self._waits_for_unheld(self.waiting[0]):
            return None
        if not self._room_for(self.waiting[0], moves):
            return None
        request = self.waiting.popleft()
        first, again = len(self.running), _prefilled_again(request)
        width = len(request.prompt_ids) + again
        rows = [Row(request, s, 0, width, resumed_tokens=again) for s in request.sequences]
        held = 0
        if self.prefixes is not None:
            held = self._reuse(request, rows[0].prompt_ids, first, len(rows), moves)
        resumed = any(sequence.tokens for sequence in request.sequences)
        return Group(first, rows, width, done_columns=held, resumed=resumed)

    def _waits_for_unheld(self, request: Submitted) -> bool:
        """Whether `request`'s prompt begins as an `unheld` group's does for `SHARED` or
        more tokens (whole blocks) past what the rows hold: admitted after their forward,
        it prefills only the rest (as it would have, one prompt a forward)."""
        prefixes = self.prefixes
        if prefixes is None or not self.unheld:
            return False
        prompt, shared = request.prompt_ids, 0
        hashes = block_hashes(prompt[: len(prompt) - 1])  # (as `lookup` counts them)
        for value in hashes:
            if value not in self._unheld_blocks:
                break
            shared += BLOCK
        return shared - prefixes.held_blocks(hashes)[1] >= SHARED

    def _reuse(
        self, request: Submitted, prompt: list[int], first: int, num_rows: int, moves: Moves
    ) -> int:
        """Copy the longest held prefix of `prompt` (what `request`'s rows prefill) into
        row `first` (after moving that row's own content out, where it is worth keeping);
        the columns held. Not for a request that asks its prompt's logprobs: they need
        every position's logits (unless it was preempted: it has them)."""
        prefixes = self.prefixes
        assert prefixes is not None
        wants_logprobs = not any(s.tokens for s in request.sequences) and any(
            s.params.prompt_logprobs is not None for s in request.sequences
        )
        source, held = (None, 0) if wants_logprobs else prefixes.lookup(prompt)
        # (row `first` holding more than the prefix reused, its own one included: requests
        # one at a time all start in row 0, which then kept only the latest prompt)
        overwritten = source != first or len(prefixes.tokens[first]) > held
        if overwritten and not prefixes.is_spare(first):
            free = range(first + num_rows, self.max_rows)
            target = prefixes.victim(free, {source} if source is not None else set())
            self._save(moves, first, target)
        if source is not None and source != first:
            self._move(moves, source, first, held)
        prefixes.hold(first, prompt[:held])
        for row in range(first + 1, first + num_rows):
            prefixes.clear(row)
        return held

    def _save(self, moves: Moves, row: int, target: int | None) -> bool:
        """Row `row`'s held prefix moved into free row `target` before `row` is
        overwritten, where it is worth more than what `target` holds and the room holds it."""
        prefixes = self.prefixes
        assert prefixes is not None
        columns = len(prefixes.tokens[row])
        if target is None or not prefixes.worth_moving(row, target):
            return False
        if not self._holds(target, columns):
            return False
        self._move(moves, row, target, columns)
        prefixes.copy(row, target, columns)
        return True


def _prefilled_again(request: Submitted) -> int:
    """How many of a preempted request's tokens its prefill writes again after its prompt
    (vLLM's recompute), where their keys and values came from decode steps that computed
    them as a prefill does (`SequenceState.exact_tokens`): all it fed (its last token is
    fed by the next decode step, whose logits pick the token after). The rest (all of them
    where its steps' bits differ from a prefill's, or it has several sequences) are fed
    again through decode steps (`Row.replaying`)."""
    if len(request.sequences) != 1:
        return 0
    sequence = request.sequences[0]
    return max(0, min(sequence.exact_tokens, len(sequence.tokens) - 1))
