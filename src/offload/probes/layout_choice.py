"""Which layout a GGUF weight is kept in on a CPU or a GPU, chosen by measuring this machine.

Each weight has the layouts its type allows (`quant/layouts.layout_for` names the one a
kernel exists for; GGUF's own blocks are always possible). When a .gguf is laid out for a
device's kernels, the one-row product (a decode step's) of each candidate is timed there
once per type and shape, on the first rows of the file's own first weight of that shape
(`timed_rows`: 16 MiB as float32 at most), and the fastest is
kept for every weight of it (the kernel's unless another is faster by more than the
timings' noise). torch's int4 kernel is fast where the CPU has the vector units it was
written for and slow elsewhere; measuring keeps a machine without them on
de-quantize-per-forward rather than on a slow kernel. The seconds measured go into the
folder's config (`layout_seconds`), so `inspect` and the docs can say why. Every layout is
exact in its own way (offloaded equals resident bitwise in each), so the choice changes
speed, not the promise.

`model/` lays a .gguf out with the chooser it is handed (a `quant/choice.LayoutChoice`):
whoever builds the model (`llm/`, `cli/`, `bench/`) passes `LayoutChooser` to
`sources.resolve_model(layout_chooser=...)`, as `model/` may not import this layer.
"""

from __future__ import annotations

import statistics
import time
import types
from typing import Any

import numpy as np
import torch

from offload.memory.cache_trust import check_inductor_cache
from offload.memory.device import synchronize
from offload.quant.gguf_quants import FORMATS
from offload.quant.kernels import q8_one_row, stored_op
from offload.quant.kinds import QuantLayout
from offload.quant.layouts import layout_for
from offload.quant.traits import laid_out, product_args

_REPEATS = 7  # timed calls of each candidate (after two warm-up calls); the median is kept
_TIMED_BYTES = 16 * 2**20  # float32 values of the rows a layout is timed on, at most
_MARGIN = 1.25  # another layout replaces the kernel's only when this much faster (noise)


def candidates(type_name: str, name: str, kernels: str, rows: int) -> list[QuantLayout]:
    """The layouts a weight may be kept in for `kernels`: the kernel's (if any), then GGUF's
    blocks."""
    layout = layout_for(type_name, name, kernels, rows)
    return [layout] if layout == QuantLayout.GGUF else [layout, QuantLayout.GGUF]


class LayoutChooser:
    """Chooses each weight's layout for `kernels` ("cpu", "cuda" or "gguf") by timing the
    candidates once per (type, shape) on the device the kernels are for."""

    def __init__(self, kernels: str):
        self.kernels = kernels
        self.seconds: dict[str, dict[str, float]] = {}  # "Q4_1 1536x576" -> layout -> s
        self._chosen: dict[str, QuantLayout] = {}

    def choose(self, name: str, raw: torch.Tensor | Any, kind: str) -> QuantLayout:
        """The layout of weight `name`, GGUF type `kind`, stored bytes `raw` [rows, bytes]
        (a tensor, or anything numpy reads with a `shape`: read and copied only when it is
        measured)."""
        options = candidates(kind, name, self.kernels, raw.shape[0])
        if len(options) == 1:
            return options[0]
        block = FORMATS[kind]
        columns = raw.shape[1] // block.block_bytes * block.block_size
        key = f"{kind} {raw.shape[0]}x{columns}"
        if key not in self._chosen:
            # Timed on a head of rows: a product's time grows with its rows, and a whole
            # large weight (a 150M-value head) would widen to GiBs of float32 here.
            rows = timed_rows(raw.shape[0], columns)
            raw = raw[:rows]
            if not isinstance(raw, torch.Tensor):  # (a mapping, or bytes read on demand)
                raw = torch.from_numpy(np.array(raw))
            device = torch.device(self.kernels)  # (the kernels' device: "cpu" or "cuda")
            measured = {
                layout: product_seconds(name, raw, kind, layout, device) for layout in options
            }
            if options[0] == QuantLayout.Q8 and not _keeps_kernel(measured, options):
                # A CPU's decode step is compiled, and there a one-row q8 product is one
                # loop (`q8_one_row`), the others opaque ops: time it as the step runs it
                # (only where the eager form lost: the loop is never slower than it).
                measured["q8 compiled"] = compiled_q8_seconds(name, raw, kind)
                measured[QuantLayout.Q8] = min(measured[QuantLayout.Q8], measured["q8 compiled"])
            self.seconds[key] = measured
            fastest = min(options, key=measured.__getitem__)
            self._chosen[key] = fastest if not _keeps_kernel(measured, options) else options[0]
        return self._chosen[key]


def timed_rows(rows: int, columns: int) -> int:
    """The rows a layout is timed on: all of a small weight's, else the whole 64s of rows
    (the CPU int4 packing's block) whose float32 values fit `_TIMED_BYTES`."""
    fitting = _TIMED_BYTES // (4 * columns) // 64 * 64
    return min(rows, max(64, fitting))


def _keeps_kernel(measured: dict[str, float], options: list[str]) -> bool:
    """Whether the kernel's layout (the first option) stays: no other is faster by more
    than the timings' noise."""
    fastest = min(options, key=measured.__getitem__)
    return not measured[fastest] * _MARGIN < measured[options[0]]


@torch.inference_mode()
def compiled_q8_seconds(name: str, raw: torch.Tensor, kind: str) -> float:
    """The median seconds of one row times the weight in the q8 layout as a compiled CPU
    step computes it (`kernels.q8_one_row`, compiled for this shape alone); infinity
    where this machine cannot compile (its steps then run eagerly)."""
    _, args = product_args(name, laid_out(name, raw, kind, QuantLayout.Q8), kind, QuantLayout.Q8)
    x = torch.randn(1, args[0].shape[0] * args[0].shape[2])
    check_inductor_cache()  # (a compile loads the kernels it finds there)
    try:
        # A fresh code object each shape: dynamo keeps its compiles (and its recompile
        # limit, 8) per code object, and past the limit it runs the loop eagerly, timing
        # the wrong product (a process laying out many shapes: a mixed file, a server).
        fresh = types.FunctionType(q8_one_row.__code__.replace(), q8_one_row.__globals__)
        product = torch.compile(fresh, dynamic=False, fullgraph=True)
        return _median_seconds(lambda: product(x, *args), torch.device("cpu"))
    except Exception:  # (no compiler here: the eager timing stands)
        return float("inf")


@torch.inference_mode()
def product_seconds(
    name: str, raw: torch.Tensor, kind: str, layout: str, device: torch.device | None = None
) -> float:
    """The median seconds of one row times the weight `raw` laid out in `layout`, on
    `device` (the CPU by default; a GPU's are timed to the end of their kernels)."""
    device = device or torch.device("cpu")
    tensors = {key: t.to(device) for key, t in laid_out(name, raw, kind, layout).items()}
    op, args = product_args(name, tensors, kind, layout)
    block = FORMATS[kind]
    x = torch.randn(1, raw.shape[1] // block.block_bytes * block.block_size, device=device)
    return _median_seconds(lambda: stored_op(op, x, *args), device)


def _median_seconds(call, device: torch.device) -> float:
    """The median seconds of `call()` over `_REPEATS` calls after two warm-up ones."""
    times = []
    for attempt in range(2 + _REPEATS):
        synchronize(device)
        started = time.perf_counter()
        call()
        synchronize(device)
        if attempt >= 2:
            times.append(time.perf_counter() - started)
    return statistics.median(times)
