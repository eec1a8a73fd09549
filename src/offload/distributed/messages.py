"""The calls rank 0's engine makes on its step runners, as the other ranks repeat them on
theirs (`worker.StageWorker`), and the handshake before. Each is a dataclass that applies
itself; they travel as JSON (`encode`, `decode`): plain numbers and lists, nothing that
runs code when read. A row travels as what a forward reads of it (`RowView`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from offload.distributed.channel import PipelineError
from offload.engine.kv_room import Keep, Move
from offload.engine.spec_tree import Tree


@dataclass
class RowView:
    """What a step runner reads of a row (`requests.Row`), and the two fields it moves on
    (`column`, `eager`: a copy's own, the worker's runner moves them as rank 0's does)."""

    start: int
    column: int
    input_token: int
    is_live: bool
    eager: bool
    prompt_ids: list[int]

    def advance(self, exact: bool) -> None:  # (`Row.advance`: rank 0's rows hold prefixes)
        self.column += self.is_live

    @staticmethod
    def of(row: Any, prompt: bool = False) -> RowView:
        ids = list(row.prompt_ids) if prompt else []
        return RowView(row.start, row.column, row.input_token, row.is_live, row.eager, ids)


@dataclass
class GroupView:
    """What a step runner reads of a prefill group (`requests.Group`)."""

    first: int
    width: int
    every_position: bool
    rows: list[RowView]

    def __post_init__(self):
        self.rows = [r if isinstance(r, RowView) else RowView(**r) for r in self.rows]

    @staticmethod
    def of(group: Any) -> GroupView:
        rows = [RowView.of(row, prompt=i == 0) for i, row in enumerate(group.rows)]
        return GroupView(group.first, group.width, group.every_position, rows)


class Message:
    """A call or a handshake step; `forward` ones give logits the last rank sends back."""

    forward: ClassVar[bool] = False

    def apply(self, worker: Any) -> Any:
        return None


@dataclass
class Hello(Message):
    """A rank's first word to rank 0: what model it built (checked to be rank 0's), and
    the bytes its budget holds in RAM (None: no budget) and its measured rates (RAM, and
    disk where its budget may stream: GB/s), which the split weighs, and where it
    computes (`join.place_of`)."""

    rank: int
    model: str
    num_layers: int
    room_bytes: int | None = None
    place: str = ""
    ram_gb_per_s: float | None = None
    disk_gb_per_s: float | None = None


@dataclass
class Layout(Message):
    """Rank 0's answer: each rank's decoder layers [start, end)."""

    stages: list[list[int]]


@dataclass
class Ready(Message):
    """A rank's stage is loaded (`error`: the one line it failed with, else None)."""

    rank: int
    error: str | None = None


@dataclass
class Open(Message):
    """A step runner made (an engine core's) with these sizes."""

    runner: int
    max_rows: int
    max_len: int
    kv_dims: list[int] | None
    invariant: bool
    pool: int | None  # the KV offload pool of its rows (`Pipeline.pool_number`), None: none

    def apply(self, worker):
        worker.open(self)


@dataclass
class RunnerCall(Message):
    runner: int


@dataclass
class Close(RunnerCall):
    def apply(self, worker):
        runner = worker.runners.pop(self.runner, None)  # (closed twice: once)
        if runner is not None:
            runner.close()


@dataclass
class Release(RunnerCall):
    keep: list[int] | None = None

    def apply(self, worker):
        worker.runners[self.runner].release(self.keep)


@dataclass
class MoveRows(RunnerCall):
    moves: list = field(default_factory=list)

    def __post_init__(self):
        self.moves = [m if isinstance(m, Move | Keep) else _move(m) for m in self.moves]

    def apply(self, worker):
        worker.runners[self.runner].move_rows(self.moves)


@dataclass
class CopyPrompt(RunnerCall):
    group: GroupView

    def __post_init__(self):
        self.group = _group(self.group)

    def apply(self, worker):
        worker.runners[self.runner].copy_prompt(self.group)


@dataclass
class ForgetStep(RunnerCall):
    def apply(self, worker):
        worker.runners[self.runner].forget_step()


@dataclass
class KeepPaths(RunnerCall):
    rows: list[RowView]
    paths: list[list[int]]

    def __post_init__(self):
        self.rows = _rows(self.rows)

    def apply(self, worker):
        worker.runners[self.runner].keep_paths(self.rows, self.paths)


@dataclass
class Prefill(RunnerCall):
    forward: ClassVar[bool] = True
    group: GroupView
    start: int
    end: int

    def __post_init__(self):
        self.group = _group(self.group)

    def apply(self, worker):
        return worker.runners[self.runner].prefill(self.group, self.start, self.end)


@dataclass
class PrefillPacked(RunnerCall):
    """Whole prompts' columns in one forward (`StepRunner.prefill_packed`)."""

    forward: ClassVar[bool] = True
    groups: list[GroupView]
    spans: list[list[int]]  # each group's [start, end)

    def __post_init__(self):
        self.groups = [_group(group) for group in self.groups]

    def apply(self, worker):
        chunks = [(g, s, e) for g, (s, e) in zip(self.groups, self.spans, strict=True)]
        out = worker.runners[self.runner].prefill_packed(chunks)
        if out is None:  # (no compiled step on a stage: its forwards always mix)
            raise PipelineError("a stage could not run a packed prefill")
        return out


@dataclass
class Mixed(RunnerCall):
    """The rows' decode step and prompts' columns in one forward (`StepRunner.packed`)."""

    forward: ClassVar[bool] = True
    rows: list[RowView]
    groups: list[GroupView]
    spans: list[list[int]]  # each group's [start, end)

    def __post_init__(self):
        self.rows = _rows(self.rows)
        self.groups = [_group(group) for group in self.groups]

    def apply(self, worker):
        chunks = [(g, s, e) for g, (s, e) in zip(self.groups, self.spans, strict=True)]
        out = worker.runners[self.runner].packed(self.rows, chunks)
        if out is None:  # (no compiled step on a stage: its forwards always mix)
            raise PipelineError("a stage could not run a mixed forward")
        return flat_logits(out)


def flat_logits(out: tuple) -> tuple:
    """A mixed forward's logits (the rows', then each chunk's) as one tuple of tensors,
    as the last rank sends them (`PipelinedRunner.packed` takes them back apart)."""
    return (out[0], *out[1])


@dataclass
class Decode(RunnerCall):
    forward: ClassVar[bool] = True
    rows: list[RowView]

    def __post_init__(self):
        self.rows = _rows(self.rows)

    def apply(self, worker):
        return worker.runners[self.runner].decode(self.rows)


@dataclass
class Verify(RunnerCall):
    forward: ClassVar[bool] = True
    rows: list[RowView]
    guesses: list[Tree | None]

    def __post_init__(self):
        self.rows = _rows(self.rows)
        self.guesses = [g if g is None or isinstance(g, Tree) else Tree(**g) for g in self.guesses]

    def apply(self, worker):
        return worker.runners[self.runner].verify(self.rows, self.guesses)


@dataclass
class Ping(Message):
    """Rank 0 is there (sent while no call is: the others' waits time out otherwise)."""


@dataclass
class Stop(Message):
    """Rank 0 is closing: the others end their loops."""


@dataclass
class Report(Message):
    """Rank 0 asks each rank for its figures (once the calls before are done)."""

    def apply(self, worker):
        worker.report()


@dataclass
class Busy(Message):
    """A rank's answer to `Report`: the seconds it has computed its stage's forwards,
    its waits for the rank before apart."""

    rank: int
    seconds: float


_KINDS = {
    cls.__name__: cls
    for cls in (
        Hello, Layout, Ready, Open, Close, Release, MoveRows, CopyPrompt, ForgetStep,
        KeepPaths, Prefill, PrefillPacked, Mixed, Decode, Verify, Ping, Stop, Report, Busy,
    )
}  # fmt: skip


def encode(message: Message) -> bytes:
    body = {f.name: getattr(message, f.name) for f in fields(message)}  # type: ignore[arg-type]
    body = json.loads(json.dumps(body, default=_plain))
    return json.dumps({"kind": type(message).__name__, "body": body}).encode()


def decode(payload: bytes) -> Message:
    try:
        data = json.loads(payload)
        return _KINDS[data["kind"]](**data["body"])
    except (ValueError, KeyError, TypeError) as error:
        raise PipelineError(f"a pipeline message could not be read ({error})") from None


def _plain(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    raise TypeError(f"{type(value).__name__} is not sent between ranks")


def _move(values: list[int]) -> Move | Keep:
    return Move(*values) if len(values) == 3 else Keep(*values)


def _rows(rows: list) -> list[RowView]:
    return [r if isinstance(r, RowView) else RowView(**r) for r in rows]


def _group(group: Any) -> GroupView:
    return group if isinstance(group, GroupView) else GroupView(**group)
