"""What the batching engine holds: a submitted request, the rows it runs in, the group
of requests being prefilled together, and the model it runs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from offload.engine.sequences import RequestOutput, SequenceState, completion_of
from offload.engine.tokens import TokenSteps
from offload.errors import ConfigError

if TYPE_CHECKING:
    from offload.engine.compiled_step import CompiledCpuStep

Emit = Callable[[RequestOutput | BaseException], None]


@dataclass
class Submitted:
    """One request in the engine: its sequences (n of them) and where its outputs go."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    sequences: list[SequenceState]
    emit: Emit
    arrival_s: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    failed: bool = False
    preemptions: int = 0  # times its rows were taken back for room (`Scheduler.make_room`)

    def output(self) -> RequestOutput:
        completions = [completion_of(i, s) for i, s in enumerate(self.sequences)]
        done = all(s.finish_reason is not None for s in self.sequences)
        first = self.sequences[0].prompt_logprobs if self.sequences else None
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_ids, completions, done, first
        )


@dataclass(eq=False)  # (a row is itself: rows of one request can hold equal values)
class Row:
    request: Submitted
    sequence: SequenceState
    start: int  # the column of its first prompt token
    column: int  # where its next token is written
    eager: bool = False  # decoded eagerly while the compiled step was not ready: stays so
    # The columns [start, exact) hold keys and values with the bits a prefill of those
    # tokens gives (its prompt's; then each decode step's that took the prefill's attention
    # kernel): what prefix caching may hand to another request.
    exact: int = -1
    resumed_tokens: int = 0  # of its tokens, those its prefill writes after its prompt

    def __post_init__(self) -> None:
        if self.exact < 0:
            self.exact = self.column

    def advance(self, exact: bool) -> None:
        """Past a decode step: the next column, if the row is live; `exact`: the step
        computed the row's keys and values as a prefill would."""
        if not self.is_live:
            return
        if exact and self.exact == self.column:
            self.exact += 1
        self.column += 1

    @property
    def is_live(self) -> bool:
        return self.sequence.finish_reason is None and not self.request.failed

    @property
    def _fed(self) -> int:
        """How many of its tokens the row's columns hold (each is fed to the step after
        the one that picked it)."""
        return self.column - self.start - len(self.sequence.prompt_ids)

    @property
    def replaying(self) -> bool:
        """Whether the next decode step feeds a token the row had before it was preempted
        (its logits then pick nothing: the next token is known)."""
        return self.is_live and self._fed < len(self.sequence.tokens) - 1

    @property
    def prompt_ids(self) -> list[int]:
        """What its prefill writes: its prompt, and where it resumes by prefilling, the
        tokens it had (`resumed_tokens`)."""
        sequence = self.sequence
        if not self.resumed_tokens:
            return sequence.prompt_ids  # (no copy: read at every prefill chunk)
        return sequence.prompt_ids + sequence.tokens[: self.resumed_tokens]

    @property
    def input_token(self) -> int:
        """The token the next decode step feeds: its last one, or the next one it
        replays."""
        tokens = self.sequence.tokens
        if not tokens:
            return 0
        return tokens[self._fed] if self.replaying else tokens[-1]


@dataclass
class Group:
    """Requests being prefilled together: rows [first, first + len(rows)), prompts
    right-aligned at column `width`."""

    first: int
    rows: list[Row]
    width: int
    done_columns: int = 0
    resumed: bool = False  # a preempted request's: its prompt's logits pick nothing
    chunks: list[torch.Tensor] = field(default_factory=list)  # logits kept for prompt logprobs

    @property
    def every_position(self) -> bool:
        """Whether its prefill keeps every position's logits (for prompt logprobs)."""
        if self.resumed:
            return False
        return any(row.sequence.params.prompt_logprobs is not None for row in self.rows)


@dataclass(frozen=True)
class EngineModel:
    """What the engine runs: the model and what turns its logits into text."""

    model: torch.nn.Module
    steps: TokenSteps
    device: torch.device
    pad_id: int
    lock: threading.Lock  # held for each forward: the model's other callers wait
    on_forward: Callable[[bool], None] = lambda compiled: None  # after each (a compiled step?)
    compiled: CompiledCpuStep | None = None  # the compiled CPU decode step, where it pays
    weights_in_place: bool = False  # its offloader leaves every weight where it is
    # after each verify forward (speculative decoding): rows guessed for, tokens guessed,
    # guesses kept
    on_verified: Callable[[int, int, int], None] = lambda drafts, guessed, kept: None
    # pipeline parallel: rank 0's `distributed.pipeline.Pipeline`, which makes the step
    # runners (each call repeated by the other ranks on their stages); None in one process
    pipeline: Any = None


def check_fits(request: Submitted, max_rows: int, max_len: int) -> None:
    """That each of `request`'s sequences fits a row of `max_len` positions and that its
    `n` sequences fit `max_rows` rows."""
    for sequence in request.sequences:
        if len(sequence.prompt_ids) + sequence.limit > max_len:
            raise ConfigError(
                f"the prompt ({len(sequence.prompt_ids)} tokens) and its output "
                f"({sequence.limit}) do not fit in {max_len} positions"
            )
    if len(request.sequences) > max_rows:
        raise ConfigError(
            f"n={len(request.sequences)} is more sequences than run at once "
            f"(max_num_seqs={max_rows})"
        )
