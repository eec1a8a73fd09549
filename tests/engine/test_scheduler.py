"""The engine core's scheduler (`engine/scheduler.py`), alone: plain Python, driven here
by random traffic against a model of the cache's rows (which request's tokens each row
holds), the way `EngineCore` drives it."""

from hypothesis import given, settings
from hypothesis import strategies as st

from offload.engine.kv_room import Keep
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


class _Columns:
    """What each of the cache's columns holds, row by row: the token whose keys and values
    were written there (moves copy them), and the memory each row holds: how far it was
    written, cut by `Keep`."""

    def __init__(self, max_rows: int):
        self.rows: list[list[int | None]] = [[] for _ in range(max_rows)]
        self.extent = [0] * max_rows

    def move(self, moves) -> None:
        for move in moves:
            if isinstance(move, Keep):
                self.rows[move.row] = self.rows[move.row][: move.columns]
                self.extent[move.row] = min(self.extent[move.row], move.columns)
                continue
            source, target, num_columns = move
            assert len(self.rows[source]) >= num_columns
            self.rows[target] = self.rows[source][:num_columns] + self.rows[target][num_columns:]
            self.extent[target] = max(self.extent[target], num_columns)

    def write(self, row: int, column: int, token: int) -> None:
        held = self.rows[row]
        held.extend([None] * (column + 1 - len(held)))
        held[column] = token
        self.extent[row] = max(self.extent[row], column + 1)

    def pages(self, page: int) -> int:
        """Columns of memory held: whole pages, one more each for where a head starts."""
        return sum((-(-e // page) + 1) * page for e in self.extent if e)


def _next_token(history: list[int]) -> int:
    """The "model": a token from everything before it, so a row whose columns were fed
    wrongly (a replay out of order, a token sampled twice) answers otherwise."""
    return hash(tuple(history)) % 5


def _turn_over_columns(scheduler: Scheduler, cache: _Columns, packs: bool = False) -> int:
    """One turn as `EngineCore._turn` runs it, over a cache of tokens: each token picked
    from the row's columns, none picked while a row replays; the tokens prefilled. `packs`:
    the prompts that end this turn are admitted first and written later, all at once (one
    forward), at the rows they were admitted into."""
    scheduler.begin_turn()
    prefilled, packed = 0, []

    def computed(group, start: int, end: int) -> None:
        prompt = group.rows[0].sequence.prompt_ids
        for column in range(start, end):
            cache.write(group.first, column, prompt[column])

    def picked(group, end: int) -> None:
        for index in range(1, len(group.rows)):
            cache.move([(group.first, group.first + index, group.width)])
        if not group.resumed:
            for index, row in enumerate(group.rows):
                row.sequence.tokens.append(_next_token(cache.rows[group.first + index][:end]))

    def flush() -> None:
        for chunk in packed:
            computed(*chunk)
        scheduler.computed()
        for group, _, end in packed:
            picked(group, end)
        packed.clear()

    while True:
        group, moves = scheduler.next_group()
        cache.move(moves)
        if group is None and packed:
            flush()
            continue
        if group is None:
            break
        start, end = scheduler.next_chunk(group)
        prompt = group.rows[0].sequence.prompt_ids
        # (what the prefix cache gave: the prompt's columns before the first chunk)
        assert cache.rows[group.first][:start] == prompt[:start]
        prefilled += end - start
        if packs and end == group.width:
            scheduler.prefilled(group, end, computed=False)
            packed.append((group, start, end))
            continue
        flush()
        computed(group, start, end)
        if not scheduler.prefilled(group, end):
            break
        picked(group, end)
    cache.move(scheduler.make_room())
    rows = scheduler.decoding()
    replaying = [row.replaying for row in rows]
    for index, row in enumerate(rows):  # (a finished row rewrites its column)
        cache.write(index, row.column, row.input_token)
        if row.is_live:
            row.column += 1
    for index, row in enumerate(rows):
        if row.is_live and not replaying[index]:
            if len(row.sequence.tokens) >= row.sequence.limit:
                row.sequence.finish_reason = "length"
            else:
                row.sequence.tokens.append(_next_token(cache.rows[index][: row.column]))
    return prefilled


@settings(max_examples=80, deadline=None)
@given(
    max_rows=st.integers(1, 6),
    chunk=st.one_of(st.none(), st.integers(8, 40)),
    arrivals=st.lists(
        st.tuples(
            st.integers(0, 8),  # the turn it arrives at
            st.integers(0, 3),  # which of the shared beginnings its prompt has
            st.integers(0, 70),  # how much of it
            st.lists(st.integers(0, 3), max_size=20),  # then its own tokens
            st.integers(1, 2),  # n
            st.integers(1, 20),  # max tokens
        ),
        min_size=1,
        max_size=14,
    ),
    cancels=st.lists(st.integers(0, 20), max_size=3),
    packs=st.booleans(),
)
def test_with_prefix_caching_every_row_holds_its_tokens_and_reuse_happens(
    max_rows, chunk, arrivals, cancels, packs
):
    """With prefix caching, requests whose prompts share beginnings arrive at random turns
    (some cancelled): the columns a prompt starts from are its own tokens, every running
    row holds its own sequence's tokens before its column, packing and admission's moves
    included (with `packs`, while prompts admitted wait for their one forward), and every
    request runs to its end."""

    beginnings = [[b * 10 + i % 7 for i in range(70)] for b in range(4)]
    scheduler, cache = Scheduler(max_rows, chunk, prefix_caching=True), _Columns(max_rows)
    requests = []
    for i, (turn, which, length, own, n, limit) in enumerate(arrivals):
        prompt = beginnings[which][:length] + own or [1]
        params = SamplingParams(n=min(n, max_rows), max_tokens=limit)
        sequences = [SequenceState(prompt, params, None, limit) for _ in range(params.n)]
        requests.append((turn, Submitted(str(i), None, prompt, sequences, lambda item: None)))
    for turn in range(400):
        scheduler.add(r for at, r in requests if at == turn)
        for index in cancels:
            if index < len(requests) and requests[index][0] + 1 == turn:
                requests[index][1].cancelled = True
        prefilled = _turn_over_columns(scheduler, cache, packs)
        assert chunk is None or prefilled <= max(chunk, 1)
        for index, row in enumerate(scheduler.running):
            written = (row.sequence.prompt_ids + row.sequence.tokens)[: row.column]
            assert cache.rows[index][: row.column] == written
        if turn > max(at for at, _ in requests) and not scheduler.has_work:
            break
    assert not scheduler.has_work
    for _, request in requests:
        ends = {s.finish_reason for s in request.sequences}
        assert ends == {"length"} or request.cancelled
    prefixes = scheduler.prefixes
    assert 0 <= prefixes.hits <= prefixes.queries


def test_prefix_caching_reuses_a_finished_prompt_and_keeps_it_through_packing():
    """Three rows: A runs and finishes, B (another beginning) runs on; packing moves B
    into A's row, so A's content is first moved to a free row; then C, which begins as A
    did for 35 tokens, starts from A's first two blocks; then D, which begins with all of
    A's prompt, from all of it."""
    scheduler, cache = Scheduler(3, None, prefix_caching=True), _Columns(3)
    a = [5] * 20 + list(range(100, 120))
    b = list(range(200, 240))
    for prompt, limit in ((a, 1), (b, 6)):
        params = SamplingParams(max_tokens=limit)
        scheduler.add(
            [Submitted("x", None, prompt, [SequenceState(prompt, params, None, limit)], print)]
        )
    _turn_over_columns(scheduler, cache)  # (A and B admitted; A ends)
    assert [row.is_live for row in scheduler.running] == [False, True]
    scheduler.begin_turn()
    group, moves = scheduler.next_group()  # (packing only: nothing waits)
    assert group is None
    assert moves == [(0, 2, 40), (1, 0, 41)]  # (A's prompt moved out before B moves in)
    cache.move(moves)
    c = [*a[:35], 7, 7, 7]
    params = SamplingParams(max_tokens=2)
    scheduler.add([Submitted("c", None, c, [SequenceState(c, params, None, 2)], print)])
    scheduler.begin_turn()
    group, moves = scheduler.next_group()
    assert group.done_columns == 32  # (two whole blocks; A's prompt is not all in C's)
    assert moves == [(2, 1, 32)]
    cache.move(moves)
    assert cache.rows[group.first][:32] == c[:32]
    assert scheduler.prefixes.hits == 32
    # D begins with all of A's prompt (a chat's next turn): all of it is reused.
    scheduler.prefilled(group, group.width)
    d = [*a, 9, 9]
    scheduler.add([Submitted("d", None, d, [SequenceState(d, params, None, 2)], print)])
    group, moves = scheduler.next_group()
    assert group.first == 2 and group.done_columns == 40  # (A's row is D's: no copy)
    assert moves == []
    assert scheduler.prefixes.hits == 32 + 40


def test_requests_one_at_a_time_leave_their_prompts_for_later_ones():
    """Requests that come one at a time all start in row 0; what row 0 held beyond the
    next prompt's reused prefix moves to a free row first: after A, B and C (one shared
    block, then each its own), A again starts from all its whole blocks, as does B."""
    scheduler, cache = Scheduler(4, None, prefix_caching=True), _Columns(4)
    shared = [5] * 16
    prompts = {name: shared + list(range(base, base + 24)) for name, base in
               (("a", 100), ("b", 200), ("c", 300))}  # fmt: skip
    hits = []
    for name in ("a", "b", "c", "a", "b"):
        before = scheduler.prefixes.hits
        params = SamplingParams(max_tokens=2)
        prompt = prompts[name]
        scheduler.add(
            [Submitted(name, None, prompt, [SequenceState(prompt, params, None, 2)], print)]
        )
        while scheduler.has_work:
            _turn_over_columns(scheduler, cache)
        hits.append(scheduler.prefixes.hits - before)
    assert hits == [0, 16, 16, 32, 32]  # (a 40-token prompt: two whole blocks reused)


def _alone(prompt: list[int], limit: int) -> list[int]:
    history = list(prompt)
    for _ in range(limit):
        history.append(_next_token(history))
    return history[len(prompt) :]


@settings(max_examples=120, deadline=None)
@given(
    max_rows=st.integers(2, 8),
    room_rows=st.integers(1, 4),
    page=st.sampled_from([1, 4, 16]),
    caching=st.booleans(),
    chunk=st.one_of(st.none(), st.integers(8, 40)),
    arrivals=st.lists(
        st.tuples(
            st.integers(0, 6),  # the turn it arrives at
            st.integers(0, 2),  # which shared beginning
            st.integers(0, 40),  # how much of it
            st.lists(st.integers(0, 3), max_size=10),  # its own tokens
            st.integers(1, 2),  # n
            st.integers(1, 30),  # max tokens
        ),
        min_size=1,
        max_size=12,
    ),
)
def test_within_a_kv_room_requests_are_preempted_and_answer_as_alone(
    max_rows, room_rows, page, caching, chunk, arrivals
):
    """Rows that take memory as they write, more of them than the room holds at full
    length: after every turn the memory the rows hold is within the room, each running
    row holds its sequence's tokens, and every request ends with the tokens it has alone,
    preempted or not (its tokens fed back in order, none picked twice)."""
    longest = 40 + 10 + 30 + 1
    room = room_rows * 2 * ((-(-longest // page) + 1) * page)  # (n=2 of the longest fit)
    scheduler = Scheduler(max_rows, chunk, prefix_caching=caching, room=room, page=page)
    cache = _Columns(max_rows)
    beginnings = [[b * 10 + i % 7 for i in range(40)] for b in range(3)]
    requests = []
    for i, (turn, which, length, own, n, limit) in enumerate(arrivals):
        prompt = beginnings[which][:length] + own or [1]
        params = SamplingParams(n=min(n, max_rows), max_tokens=limit)
        sequences = [SequenceState(prompt, params, None, limit) for _ in range(params.n)]
        request = Submitted(str(i), None, prompt, sequences, lambda item: None)
        scheduler.check_fits(request)
        requests.append((turn, request))
    for turn in range(2000):
        scheduler.add(r for at, r in requests if at == turn)
        _turn_over_columns(scheduler, cache)
        assert cache.pages(page) <= room
        for index, row in enumerate(scheduler.running):
            fed = row.column - len(row.sequence.prompt_ids)
            written = row.sequence.prompt_ids + row.sequence.tokens[:fed]
            assert cache.rows[index][: row.column] == written
        if turn > max(at for at, _ in requests) and not scheduler.has_work:
            break
    assert not scheduler.has_work
    for _, request in requests:
        for sequence in request.sequences:
            assert sequence.tokens == _alone(request.prompt_ids, sequence.limit)


def test_the_youngest_request_is_preempted_and_resumes_by_replaying_its_tokens():
    """Room for 30 columns, two requests of 8-token prompts and 12 tokens each: both
    start, and when their rows outgrow the room, B (the younger) is preempted, its memory
    given back; once A is done, B's prompt is prefilled again and its tokens fed back one
    step each before it picks new ones; both end as they would alone."""
    scheduler, cache = Scheduler(4, None, room=30, page=1), _Columns(4)
    prompts = [list(range(10, 18)), list(range(20, 28))]
    requests = []
    for name, prompt in zip("ab", prompts, strict=True):
        params = SamplingParams(max_tokens=12)
        request = Submitted(name, None, prompt, [SequenceState(prompt, params, None, 12)], print)
        scheduler.check_fits(request)
        requests.append(request)
    scheduler.add(requests)
    seen_replay = False
    for _ in range(100):
        _turn_over_columns(scheduler, cache)
        assert cache.pages(1) <= 30
        seen_replay |= any(row.replaying for row in scheduler.running)
        if requests[1].preemptions and not requests[0].output().finished:
            assert [row.request for row in scheduler.running] == [requests[0]]
        if not scheduler.has_work:
            break
    assert requests[0].preemptions == 0 and requests[1].preemptions >= 1
    assert scheduler.num_preemptions == requests[1].preemptions
    assert seen_replay
    for request in requests:
        assert request.sequences[0].tokens == _alone(request.prompt_ids, 12)
