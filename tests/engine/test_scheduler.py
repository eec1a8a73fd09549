"""The engine core's scheduler (`engine/scheduler.py`), alone: plain Python, driven here
by random traffic against a model of the cache's rows (which request's tokens each row
holds), the way `EngineCore` drives it."""

from hypothesis import given, settings
from hypothesis import strategies as st

from offload.engine.requests import Submitted
from offload.engine.sampling_params import SamplingParams
from offload.engine.scheduler import Scheduler
from offload.engine.sequences import SequenceState


def _request(number: int, prompt_len: int, n: int, limit: int) -> Submitted:
    params = SamplingParams(n=n, max_tokens=limit)
    prompt = list(range(1, prompt_len + 1))
    sequences = [SequenceState(prompt, params, None, limit) for _ in range(n)]
    return Submitted(str(number), None, prompt, sequences, lambda item: None)


class _Cache:
    """What each of the cache's rows holds: (request id, sequence index, columns written)."""

    def __init__(self, max_rows: int):
        self.rows: list[tuple | None] = [None] * max_rows

    def move(self, moves) -> None:
        for source, target, num_columns in moves:
            request, sequence, written = self.rows[source]
            assert written >= num_columns
            self.rows[target] = (request, sequence, num_columns)


def _turn(scheduler: Scheduler, cache: _Cache) -> int:
    """One turn as `EngineCore._turn` runs it, the forwards simulated: the tokens
    prefilled."""
    scheduler.begin_turn()
    prefilled = 0
    while True:
        group, moves = scheduler.next_group()
        cache.move(moves)
        if group is None:
            break
        start, end = scheduler.next_chunk(group)
        assert 0 <= start < end <= group.width
        prefilled += end - start  # (in the group's first row; the others copy it)
        if not scheduler.prefilled(group, end):
            break
        for index, row in enumerate(group.rows):
            sequence = row.request.sequences.index(row.sequence)
            cache.rows[group.first + index] = (row.request.request_id, sequence, end)
    for index, row in enumerate(scheduler.decoding()):
        if row.is_live:
            row.sequence.tokens.append(0)
            request, sequence, written = cache.rows[index]
            cache.rows[index] = (request, sequence, written + 1)
            row.column += 1
            if len(row.sequence.tokens) >= row.sequence.limit:
                row.sequence.finish_reason = "length"
    return prefilled


@settings(max_examples=60, deadline=None)
@given(
    max_rows=st.integers(1, 6),
    chunk=st.one_of(st.none(), st.integers(1, 12)),
    arrivals=st.lists(
        st.tuples(st.integers(0, 6), st.integers(1, 9), st.integers(1, 3), st.integers(1, 5)),
        min_size=1,
        max_size=12,
    ),
    cancels=st.lists(st.integers(0, 20), max_size=3),
)
def test_every_running_row_holds_its_own_sequence_and_every_request_ends(
    max_rows, chunk, arrivals, cancels
):
    """Requests arrive at random turns, some are cancelled: after every turn each running
    row of the cache holds its own sequence's columns (packing moved them with it), the
    rows being prefilled sit right after the running ones, a turn prefills no more than
    `max_num_batched_tokens`, and every request not cancelled runs to its end."""
    scheduler, cache = Scheduler(max_rows, chunk), _Cache(max_rows)
    requests = [
        (turn, _request(i, width, min(n, max_rows), limit))
        for i, (turn, width, n, limit) in enumerate(arrivals)
    ]
    for turn in range(200):
        scheduler.add(r for at, r in requests if at == turn)
        for index in cancels:
            if index < len(requests) and requests[index][0] + 1 == turn:
                requests[index][1].cancelled = True
        prefilled = _turn(scheduler, cache)
        assert chunk is None or prefilled <= chunk
        for index, row in enumerate(scheduler.running):
            sequence = row.request.sequences.index(row.sequence)
            held = cache.rows[index]
            assert held[:2] == (row.request.request_id, sequence)
            assert held[2] >= row.column  # (a finished row keeps its place till packed)
        if scheduler.group is not None:
            assert scheduler.group.first == len(scheduler.running)
        if turn > max(at for at, _ in requests) and not scheduler.has_work:
            break
    assert not scheduler.has_work
    for _, request in requests:  # (one cancelled while it waited is just dropped)
        ends = {s.finish_reason for s in request.sequences}
        assert ends == {"length"} or request.cancelled
