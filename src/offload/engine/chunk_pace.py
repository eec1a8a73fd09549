"""How many prompt tokens a turn carries beside the running rows' decode step when the user
set no `max_num_batched_tokens` (chunked prefill by default, as vLLM v1 always chunks).

A fixed number fits no machine: a chunk that keeps the streams' pace on a 2-core CPU (8-16
tokens) would take 125-250 weight streams for a 2000-token prompt on the disk tier, where a
decode step is a stream and a chunk of hundreds costs little more. So the budget follows
what the turns measure (`ChunkPace`): a turn's prompt tokens may take about as long as a
plain decode step takes (`SHARE`), so the streams keep half their pace or more while a
long prompt comes in, and the prompt takes about twice its prefill alone. Each request
waiting for a free row gets that share, and where as many wait as rows decode, the turn
takes their prompts whole: a burst of chats arriving while an answer decodes is admitted
in one forward, not one chunk at a time.

The measured budget changes what each turn carries, never a token's bits: it is used only
where every prompt position and every decode row computes the same bits however the prompt
is cut and whoever rides beside it (a CPU's row-invariant products, `StepRunner.packs`).
"""

from __future__ import annotations

import statistics
import time
from collections import deque

from offload.engine import step_jobs

FLOOR = 8  # tokens: a turn's least, and its unit (16 while such turns ran eagerly)
SHARE = 1.0  # a turn's prompt time over a plain decode step's, per waiting request
KEEP = 9  # latest measurements whose median is used


class ChunkPace:
    """The prompt tokens of the next turn in which rows decode, from the times of the
    latest plain decode steps and of the prompt tokens' compute."""

    def __init__(self):
        self._steps: deque[float] = deque(maxlen=KEEP)  # seconds a plain decode step
        # (prompt tokens, seconds they added to their forward): its decode step's time off
        self._prompts: deque[tuple[int, float]] = deque(maxlen=KEEP)

    @staticmethod
    def start() -> float | None:
        """A measured forward's start; None while a step's compile or load runs in the
        background (its turns are no measure of the steady ones)."""
        return None if step_jobs.busy() else time.perf_counter()

    def decoded(self, began: float | None) -> None:
        """A plain decode step that began at `began` (`start`) has ended."""
        seconds = self._since(began)
        if seconds is not None:
            self._steps.append(seconds)

    def prefilled(self, tokens: int, began: float | None) -> None:
        """A forward of `tokens` prompt tokens (beside the running rows' decode step, or
        alone) that began at `began` has ended."""
        seconds = self._since(began)
        if seconds is None or tokens <= 0:
            return
        step = statistics.median(self._steps) if self._steps else 0.0
        # (a floor: a turn faster than the steps' median says little about a token)
        self._prompts.append((tokens, max(seconds - step, 0.05 * seconds)))

    @staticmethod
    def _since(began: float | None) -> float | None:
        if began is None or step_jobs.busy():
            return None
        return time.perf_counter() - began

    def budget(self, waiting: int, decoding: int) -> int | None:
        """The prompt tokens of a turn in which `decoding` rows decode while `waiting`
        requests that the free rows take wait (the one being prefilled included); None
        (whole prompts) where as many wait as decode: a burst's stall is shared by fewer
        than it admits."""
        if waiting >= decoding:
            return None
        if not self._steps or not self._prompts:
            return FLOOR  # (nothing measured yet: the least, measured from then on)
        # Seconds a token: the latest forwards' together, so that the large ones count
        # most (a small forward's time is mostly what every forward costs)
        per_token = sum(s for _, s in self._prompts) / sum(n for n, _ in self._prompts)
        share = SHARE * max(1, waiting)
        tokens = share * statistics.median(self._steps) / per_token
        return FLOOR * max(1, int(tokens // FLOOR))
