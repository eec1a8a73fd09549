from hypothesis import given
from hypothesis import strategies as st

from offload.memory.slots import SlotTable, next_in_slot, num_slots, slot_of, slot_sizes


def test_slots_and_sizes():
    assert num_slots(5, 2) == 2 and num_slots(2, 4) == 2
    assert [slot_of(p, 3) for p in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert slot_sizes([10, 30, 20, 5, 40], 2) == [40, 30]


def test_next_in_slot_wraps_to_the_slots_own_first_occupant():
    # 5 layers, 2 slots: slot 0 holds 0, 2, 4 and slot 1 holds 1, 3.
    assert [next_in_slot(p, 5, 2) for p in range(5)] == [2, 3, 4, 1, 0]
    # vLLM's (p + k) % n would load layer 1 after layer 4, into slot 0, which layer 1 does
    # not use, and layer 0 after layer 3, into slot 1 while layer 4 still needs it.


def _simulate(num_offloaded, step, order):
    """Run the table through `order` (positions as layers run). The slot contents are
    what the issued loads put there, in issue order (the copy engine keeps that order
    and each load waits for the slot's last reader). Returns the loads issued."""
    table = SlotTable(num_offloaded, step)
    content = [None] * table.slots
    loads = []

    def load(position):
        table.start_load(position)
        content[slot_of(position, table.slots)] = position
        loads.append(position)
        table.finish_load(position)

    for position in table.initial_loads():
        load(position)
    for position in order:
        if table.needs_load(position):
            load(position)
        assert content[slot_of(position, table.slots)] == position, "a layer read another's slot"
        following = table.next_load(position)
        if following is not None:
            load(following)
    return loads


@given(st.integers(1, 12), st.integers(1, 6), st.integers(1, 4), st.data())
def test_any_run_order_reads_the_right_weights(num_offloaded, step, num_forwards, data):
    """Forwards that skip, repeat or reorder layers never read a slot that holds another
    layer's weights."""
    positions = st.integers(0, num_offloaded - 1)
    order = data.draw(st.lists(positions, max_size=6 * num_offloaded))
    _simulate(num_offloaded, step, order)


@given(st.integers(1, 12), st.integers(1, 6), st.integers(2, 4))
def test_in_order_forwards_load_each_shared_layer_once_and_never_stall(
    num_offloaded, step, num_forwards
):
    order = list(range(num_offloaded)) * num_forwards
    table = SlotTable(num_offloaded, step)
    loads = _simulate(num_offloaded, step, order)
    slots = table.slots
    occupants = [sum(1 for q in range(num_offloaded) if q % slots == s) for s in range(slots)]
    shared = [p for p in range(num_offloaded) if occupants[p % slots] > 1]
    # Initial loads, then per forward one load per layer whose slot it shares.
    assert len(loads) == slots + num_forwards * len(shared)
    # No on-demand loads in the steady state: every load was a prefetch.
    table = SlotTable(num_offloaded, step)
    for position in table.initial_loads():
        table.finish_load(position)
    for position in order:
        assert not table.needs_load(position)
        following = table.next_load(position)
        if following is not None:
            table.finish_load(following)


@given(st.integers(1, 12), st.integers(1, 6), st.data())
def test_a_load_cut_short_at_any_step_is_loaded_again_before_use(num_offloaded, step, data):
    """An interrupted load (after `start_load`, with or without its copy issued) leaves
    the slot unknown: whoever runs next in that slot loads it again, so nobody reads
    bytes that no recorded load put there."""
    table = SlotTable(num_offloaded, step)
    content = [None] * table.slots  # what the copies issued so far put in each slot
    for position in table.initial_loads():
        table.start_load(position)
        content[slot_of(position, table.slots)] = position
        table.finish_load(position)
    positions = st.integers(0, num_offloaded - 1)
    for position in data.draw(st.lists(positions, max_size=4 * num_offloaded)):
        if data.draw(st.booleans()):  # a load into this slot cut short
            slot = position % table.slots
            victim = data.draw(st.sampled_from(range(slot, num_offloaded, table.slots)))
            table.start_load(victim)
            if data.draw(st.booleans()):  # its copy was issued before the interrupt
                content[slot_of(victim, table.slots)] = victim
        if table.needs_load(position):
            table.start_load(position)
            content[slot_of(position, table.slots)] = position
            table.finish_load(position)
        assert content[slot_of(position, table.slots)] == position
