"""The decode step as CUDA graphs: captured once per KV-copy length, then replayed for
every token, with the weight and KV offloaders' copies inside the graph.

A graph replays fixed work: the same kernels on the same addresses, copies of the same
sizes. The static KV cache and the offloaders' slots give the fixed addresses; the step's
inputs go through static buffers. What still varies is how many KV positions must be
brought in for each layer; so a graph is captured per power-of-two bucket of positions
and a step replays the smallest one that covers what has been written.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace

import torch

from offload.engine.kv_cache import KVOffloader
from offload.engine.transfer_stats import TransferStats
from offload.engine.transformers_cache import cache_argument
from offload.errors import OffloadError
from offload.offloader.base import BaseOffloader

_MIN_BUCKET = 64


def kv_bucket(num_positions: int, max_positions: int) -> int:
    """The KV rows a graph copies for a step that reads `num_positions`: the next power
    of two (at least 64), never past the cache."""
    bucket = _MIN_BUCKET
    while bucket < num_positions:
        bucket *= 2
    return min(bucket, max_positions)


class DecodeStep:
    """A model's decode forward over static buffers: the token, position and cache
    position of each step are copied in, and the attention mask is updated in place, so
    the same addresses serve every step (what a CUDA graph replays)."""

    def __init__(self, model: torch.nn.Module, cache, mask: torch.Tensor, positions: torch.Tensor):
        batch = mask.shape[0]
        self._model = model
        self._cache = cache_argument(model, cache)  # (once: dynamo cannot trace its lookup)
        self.mask = mask  # [batch, length]
        self.input_ids = torch.zeros(batch, 1, dtype=torch.long, device=mask.device)
        # [batch, 1], laid out alike whatever the prompt's width (a clone of the column keeps
        # the width as its row stride, and a compiled step guards strides: a new prompt
        # length would compile again).
        self.position_ids = torch.empty_like(
            positions[:, -1:], memory_format=torch.contiguous_format
        )
        self.position_ids.copy_(positions[:, -1:])
        self.cache_position = torch.zeros(1, dtype=torch.long, device=mask.device)

    def prepare(self, tokens: torch.Tensor, position: int) -> None:
        """Inputs of the step that writes cache position `position`."""
        self.input_ids.copy_(tokens[:, None])
        self.position_ids.add_(1)
        self.cache_position.fill_(position)
        self.mask[:, position] = 1

    def __call__(self) -> torch.Tensor:
        return last_logits(self)


def last_logits(step, mask=None) -> torch.Tensor:
    """The one-token forward of `step` (a `DecodeStep` or a `rows.RowStep`: its model,
    cache argument and inputs; `mask`: the masks in place of its 2D one); the logits of
    each row's new token, [rows, vocab]."""
    out = step._model(
        input_ids=step.input_ids,
        attention_mask=step.mask if mask is None else mask,
        position_ids=step.position_ids,
        **step._cache,
        cache_position=step.cache_position,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1, :]


class DecodeGraphs:
    """Capture-on-first-use CUDA graphs of `step`, a function of static buffers that runs
    one decode forward and returns its (static) logits.

    Bytes the offloaders move inside a graph are counted once, at capture, by their
    own counters; `replayed` adds what the replays moved, so figures stay true.
    """

    def __init__(
        self,
        step: Callable[[], torch.Tensor],
        offloader: BaseOffloader,
        kv: KVOffloader | None,
    ):
        self._step = step
        self._offloader = offloader
        self._kv = kv
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, TransferStats]] = {}
        self._pool = None
        self.replayed = TransferStats()  # what the replays moved, and how many there were

    def run(self, num_positions: int) -> torch.Tensor:
        """One decode step reading `num_positions` cache positions: replay (capturing
        first if needed) the graph of its bucket."""
        rows = kv_bucket(num_positions, self._kv.shape.max_cache_len) if self._kv else 0
        captured = rows not in self._graphs
        if captured:
            self._graphs[rows] = self._capture(rows)
        graph, logits, moved = self._graphs[rows]
        with self._around():
            graph.replay()
        self.replayed += moved
        if self._kv is not None and not captured:
            # The capture ran the step's Python (which counted its positions); a replay
            # runs none, so its position is counted here.
            self._kv.count_replayed_step()
        return logits

    @contextlib.contextmanager
    def _around(self):
        # Compute first waits for copies issued before (by eager steps). The graph's own
        # KV copies were joined into it at capture, so nothing is left to join after.
        if self._kv is not None:
            self._kv.synchronize()
        with self._offloader.graph_capture():
            yield

    def _capture(self, rows: int):
        graph = torch.cuda.CUDAGraph()
        before = self._counters()
        if self._kv is not None:
            self._kv.capture_rows = rows
            self._kv.synchronize()
        try:
            with self._offloader.graph_capture(graph, pool=self._pool):
                logits = self._step()
                if self._kv is not None:
                    self._kv.synchronize()  # joins the KV copy stream into the capture
        except RuntimeError as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise OffloadError(
                f"capturing the decode step as a CUDA graph failed ({first_line}); "
                "pass enforce_eager=True (--enforce-eager) to decode without graphs"
            ) from error
        self._pool = graph.pool()
        moved = replace(self._counters() - before, num_graph_replays=1)
        return graph, logits, moved

    def _counters(self) -> TransferStats:
        kv = self._kv.stats() if self._kv is not None else None
        return TransferStats.of(self._offloader.stats(), kv)
