"""The engine core's turn in which prompts ride in the running rows' decode step (chunked
prefill mixed with decode, `mixed_step`): the turn's prompt tokens, `max_num_batched_tokens`
or what `ChunkPace` measures, go through one forward beside the rows' new tokens, the
weights read once. Where the runner `packs` (each prompt's bits its own however it is cut
and whoever rides beside it), the turn carries every waiting prompt that fits whole and the
first part of the next; elsewhere one chunk of one prompt."""

from __future__ import annotations

from offload.engine.requests import Group, Row


class MixedTurn:
    """`core`'s (an `EngineCore`, not imported: it imports this) mixed turns."""

    def __init__(self, core, pace):
        self.core, self.pace = core, pace  # (`pace`: a `ChunkPace`, measured here)

    def budget(self, decoding: list[Row]) -> int | None:
        """The paced prompt tokens of a turn in which `decoding` rows decode (`ChunkPace`),
        for the requests that their free rows take."""
        scheduler = self.core.scheduler
        live = sum(row.is_live for row in decoding)
        return self.pace.budget(min(scheduler.num_waiting, scheduler.max_rows - live), live)

    def __call__(self) -> None:
        """Admit the next waiting requests, make the running rows' KV room, and run one
        forward of the rows' decode step and the turn's prompt tokens."""
        core = self.core
        scheduler, runner = core.scheduler, core.runner
        _, moves = scheduler.next_group()
        runner.move_rows(moves)  # (packed whether or not a request is admitted)
        core._stepped()
        runner.move_rows(scheduler.make_room())  # (a KV room: preempting, if need be)
        rows = list(scheduler.decoding())
        chunks: list[tuple[Group, int, int]] = []
        whole: list[Group] = []  # (admitted and running once this forward runs)
        group = scheduler.group  # (none if preempted to make room)
        while group is not None:
            start, end = scheduler.next_chunk(group)
            chunks.append((group, start, end))
            if not (runner.packs and end == group.width and not group.every_position):
                break  # (its rest at the next turns, or it is whole once this one runs)
            scheduler.prefilled(group, end, computed=False)
            whole.append(group)
            group, moves = scheduler.next_group()
            runner.move_rows(moves)
        if not chunks:  # (nothing admitted: a plain step)
            core.decode_turn(rows)
            return
        both = rows + [row for group, _, _ in chunks for row in group.rows]
        began = self.pace.start()
        ran = core._run_forward(both, self._forward, rows, chunks, whole)
        tokens = sum(end - start for _, start, end in chunks)
        if ran:
            self.pace.prefilled(tokens, began)
        else:
            scheduler.computed(done=False)  # (their requests failed with the rows')
            if scheduler.group is chunks[-1][0]:
                scheduler.drop_group()
        core._stepped()

    def _forward(self, rows: list[Row], chunks: list, whole: list[Group]) -> None:
        core = self.core
        replaying = [row.replaying for row in rows]  # (before the step moves their columns)
        out = core.runner.packed(rows, chunks) if rows else None
        if out is None:  # (not now, or no row left to decode: the forwards apart)
            if rows:
                core._pick(rows, core.runner.decode(rows), replaying)
            found = [core.runner.prefill(*chunk) for chunk in chunks]
        else:
            core._pick(rows, out[0], replaying)
            found = out[1]
        if whole:
            core.scheduler.computed()
        for index, ((group, _, end), logits) in enumerate(zip(chunks, found, strict=True)):
            if index < len(whole):  # (the whole ones come first: `__call__`)
                core._whole(group, logits)
            else:
                core._prefilled(group, end, logits)
