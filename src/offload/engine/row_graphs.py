"""The engine core's decode step as CUDA graphs: one per (rows, read width), captured on
first use and replayed at every later step of that shape, with the weight offloader's
copies inside the graph (`BaseOffloader.graph_capture`), as vLLM captures its decode.

A graph replays fixed work on fixed addresses, so each shape keeps its own `RowStep`
whose input tensors the graph reads; a step's inputs are copied into them before the
replay. The rows run are rounded up to a power of two (the rest padding rows, which
write only the column past `max_len`) and the width is `rows.read_width`'s power of two,
so a few graphs serve every batch. Every decode step of a shape is a replay, its first
one too (an eager warm-up runs before the capture and its logits are dropped): which
graphs were captured before never changes an answer's bits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import torch

from offload.engine.rows import RowStep
from offload.engine.transfer_stats import TransferStats
from offload.errors import OffloadError


class GraphMaker(Protocol):
    """How graphs are made and replayed: CUDA's (`CudaGraphMaker`), or a stand-in that
    runs the step again at each replay (tests on a CPU)."""

    def capture(self, step: Callable[[], torch.Tensor], pool: Any) -> tuple[Any, torch.Tensor]:
        """(graph, the logits tensor it writes) of `step`, captured."""
        ...

    def replay(self, graph: Any) -> None: ...

    def pool(self, graph: Any) -> Any: ...


class CudaGraphMaker:
    """CUDA graphs of forwards of a model offloaded by `offloader` (its copies captured
    with the forward: `BaseOffloader.graph_capture`)."""

    def __init__(self, offloader) -> None:
        self._offloader = offloader

    def capture(self, step, pool):
        graph = torch.cuda.CUDAGraph()
        try:
            with self._offloader.graph_capture(graph, pool=pool):
                logits = step()
        except RuntimeError as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise OffloadError(
                f"capturing the decode step as a CUDA graph failed ({first_line}); "
                "pass enforce_eager=True (--enforce-eager) to decode without graphs"
            ) from error
        return graph, logits

    def replay(self, graph) -> None:
        with self._offloader.graph_capture():  # (compute waits for copies issued before)
            graph.replay()

    def pool(self, graph):
        return graph.pool()


class RowGraphs:
    """The graphs of one `RowCache`'s decode steps (see the module). `counters()` gives
    the offloader's running byte counts: what a capture moved is what each replay moves."""

    def __init__(
        self, maker: GraphMaker, held_rows: int, counters: Callable[[], TransferStats]
    ) -> None:
        self._maker = maker
        self._held = held_rows
        self._counters = counters
        self._graphs: dict[tuple[int, int], tuple[Any, RowStep, torch.Tensor, TransferStats]] = {}
        self._pool = None
        self.replayed = TransferStats()  # what the replays moved, and how many there were

    def rows_for(self, num_rows: int) -> int:
        """The rows a graph runs for `num_rows` running ones: the next power of two, never
        more than the cache holds."""
        rows = 1
        while rows < num_rows:
            rows *= 2
        return min(rows, self._held)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def run(self, step: RowStep, warm_up: Callable[[RowStep], torch.Tensor]) -> torch.Tensor:
        """The logits of `step` (rows padded to `rows_for`), replayed from its shape's
        graph; captured first where there is none (after `warm_up(step)`, an eager run)."""
        key = (step.columns.shape[0], step.mask.shape[1])
        kept, captured_now = self._graphs.get(key), False
        if kept is None:
            warm_up(step)  # (lazy initialisations run outside the capture)
            before = self._counters()
            graph, logits = self._maker.capture(step, self._pool)
            self._pool = self._maker.pool(graph)
            moved = replace(self._counters() - before, num_graph_replays=1)
            kept = self._graphs[key] = (graph, step, logits, moved)
            captured_now = True  # (its copies counted by the offloader at the capture)
        graph, captured, logits, moved = kept
        if captured is not step:
            for mine, new in zip(captured.inputs, step.inputs, strict=True):
                mine.copy_(new)
        self._maker.replay(graph)
        self.replayed += replace(TransferStats(), num_graph_replays=1) if captured_now else moved
        return logits
