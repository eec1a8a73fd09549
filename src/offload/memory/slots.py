"""Which device slot each offloaded position uses, and when each is loaded.

Pure functions and a small host-side state machine, no tensors: the weight offloader
(positions are offloaded layers) and the KV cache (positions are cache layers) share this
schedule, and the tests drive it through every shape of model.

Offloaded positions are numbered 0..n-1 in execution order. With k slots,
position p always uses slot p % k (so its tensors can be permanent views of that
slot). Once position p has run, its slot is refilled with the *next occupant of the same
slot* in circular order: p + k, or, past the end, the slot's first occupant for the
next forward. That is vLLM's "prefetch k ahead" in the steady state, and stays correct
when n is not a multiple of k (vLLM's `(p + k) % n` overwrote a slot still needed).
A slot with a single occupant is filled once and never again.
"""

from __future__ import annotations


def num_slots(num_offloaded: int, prefetch_step: int) -> int:
    """Device slots in the ring: `prefetch_step`, but never more than there are layers."""
    return min(prefetch_step, num_offloaded)


def slot_of(position: int, slots: int) -> int:
    return position % slots


def next_in_slot(position: int, num_offloaded: int, slots: int) -> int:
    """The position to load into `position`'s slot once `position` has run."""
    following = position + slots
    return following if following < num_offloaded else position % slots


def slot_sizes(layer_bytes: list[int], slots: int) -> list[int]:
    """Each slot is as large as the largest layer it serves."""
    sizes = [0] * slots
    for position, num_bytes in enumerate(layer_bytes):
        slot = slot_of(position, slots)
        sizes[slot] = max(sizes[slot], num_bytes)
    return sizes


class SlotTable:
    """Host-side record of which layer each slot holds.

    Every overwrite of a slot is decided here, on the host, in program order: a load is
    issued either after the slot's current occupant has run (`next_load`) or, when a
    layer is about to run and its slot holds something else (a skipped or repeated
    layer, the first forward), right before it (`needs_load`). So a layer never reads a
    slot that holds another layer's weights, whatever the order layers run in.

    The queries change nothing; a load is recorded in two steps around the copy it
    issues: `start_load` marks the slot's contents unknown, `finish_load` (once the copy
    is queued and its ticket kept) names the new occupant. An exception or Ctrl-C
    anywhere in between leaves the slot unknown, so its next user loads it again: a
    copy queued behind the interrupted one, never a read of bytes nobody waited for.
    """

    def __init__(self, num_offloaded: int, prefetch_step: int):
        self.num_offloaded = num_offloaded
        self.slots = num_slots(num_offloaded, prefetch_step)
        self.owner: list[int | None] = [None] * self.slots  # None: empty or unknown

    def initial_loads(self) -> list[int]:
        """Positions to load before the first forward: each slot's first occupant."""
        return list(range(self.slots))

    def needs_load(self, position: int) -> bool:
        """True if `position` must be loaded before it runs: its slot holds another layer
        (or contents nobody recorded)."""
        return self.owner[slot_of(position, self.slots)] != position

    def next_load(self, position: int) -> int | None:
        """The position to load into the slot `position` just used, or None when the
        slot already holds it (a slot whose only occupant is `position` stays loaded)."""
        following = next_in_slot(position, self.num_offloaded, self.slots)
        if self.owner[slot_of(following, self.slots)] == following:
            return None
        return following

    def start_load(self, position: int) -> None:
        """A copy into `position`'s slot is about to be issued: its contents are unknown."""
        self.owner[slot_of(position, self.slots)] = None

    def finish_load(self, position: int) -> None:
        """The copy of `position` is queued (and its ticket kept): the slot is its."""
        self.owner[slot_of(position, self.slots)] = position
