"""A CPU's one memory budget (docs/design.md, "A CPU's memory budget"). On a CPU the device
is the host's RAM, so `cpu_memory_gb` (B) bounds the process's peak RSS, less a fixed
overhead stated here:

- B holds the layer stack's weights in RAM (layers not offloaded, offloaded layers kept,
  the slots, and mapped checkpoint pages, which count in RSS once touched), the KV cache
  and a step's activations (`RamUse`);
- the fixed overhead holds the process (Python, torch and transformers imported, the empty
  model built), the weights outside the stack (embeddings, final norm, lm_head) and the
  tokenizer (`planner/overhead.py`, which the run states too), whatever the placement.

Pure arithmetic on a `ModelShape` and a `Layout`: it decides nothing and builds nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from offload.errors import ModelError
from offload.memory.placement import DiskIO, Placement
from offload.planner.fit import MARGIN_BYTES
from offload.planner.layouts import Layout, hundredths, prefetch, prefetch_within
from offload.planner.overhead import PROCESS_BASELINE_BYTES, FixedOverhead
from offload.planner.shape import ModelShape
from offload.sizes import GIB, format_bytes


@dataclass(frozen=True)
class RamUse:
    """What a placement holds in a CPU's budget, by kind (bytes)."""

    layer_bytes: int  # the stack's weights in RAM: resident, kept and mapped layers
    staging_bytes: int  # the slots offloaded layers are copied or read into
    kv_bytes: int
    activation_bytes: int
    margin_bytes: int = MARGIN_BYTES  # allocator slack, as the engine counts it

    @property
    def total_bytes(self) -> int:
        return (
            self.layer_bytes
            + self.staging_bytes
            + self.kv_bytes
            + self.activation_bytes
            + self.margin_bytes
        )

    def describe(self) -> str:
        parts = (
            ("layers", self.layer_bytes),
            ("slots", self.staging_bytes),
            ("KV cache", self.kv_bytes),
            ("activations", self.activation_bytes),
            ("slack", self.margin_bytes),
        )
        return ", ".join(f"{name} {format_bytes(size)}" for name, size in parts if size)


def ram_use(shape: ModelShape, layout: Layout, kv_bytes: int) -> RamUse:
    """What `layout` holds in RAM with `kv_bytes` of KV cache: the layers it does not
    offload, the offloaded layers it keeps, the pages of those it maps, and its slots."""
    mapped = sum(
        b for p, b in zip(layout.places, layout.off_bytes, strict=True) if p == Placement.MAPPED
    )
    layers = sum(shape.layer_bytes) - layout.offloaded_bytes + layout.host_bytes + mapped
    return RamUse(layers, layout.staging_bytes, kv_bytes, shape.activation_bytes)


def least_layout(shape: ModelShape) -> Layout:
    """The placement that needs the least RAM: every layer read from disk with
    `O_DIRECT`, into the fewest slots the disk tier reads ahead with."""
    return prefetch(shape, 1, 1, 1, 0, DiskIO.DIRECT)


def least_ram(shape: ModelShape, batch: int, context_len: int) -> RamUse:
    """The least RAM `batch` sequences of `context_len` positions can run in (no more
    than every layer resident: the slots are never more than the layers)."""
    return ram_use(shape, least_layout(shape), shape.kv_bytes(batch, context_len))


def ram_budget_error(shape: ModelShape, ram_bytes: int, batch: int, context_len: int) -> ModelError:
    """Why a budget of `ram_bytes` cannot hold `batch` sequences, with the numbers and
    what would fit: the least budget, or the most positions this one holds."""
    least = least_ram(shape, batch, context_len)
    # (activations shrink with the context too: what they take at this one is an upper bound)
    room = ram_bytes - (least.total_bytes - least.kv_bytes)
    per_position = shape.kv_bytes_per_position * batch
    positions = room // per_position if per_position else 0
    shorter = f", or --context-len {positions} in this one" if positions >= 1 else ""
    least_gb = hundredths(least.total_bytes / GIB, math.ceil)
    sequences = "one sequence" if batch == 1 else f"{batch} sequences"
    return ModelError(
        f"cpu_memory_gb={ram_bytes / GIB:g} GiB cannot hold {sequences} of {context_len} "
        f"positions: with every layer read from disk it needs "
        f"{format_bytes(least.total_bytes)} ({least.describe()}); --cpu-memory-gb "
        f"{least_gb:g} fits{shorter}"
    )


def describe_budget(
    shape: ModelShape, overhead: FixedOverhead, ram_bytes: int | None, context_len: int
) -> list[str]:
    """A CPU's budget for people (`offload inspect`): the fixed overhead and, given a
    budget, what it holds for one sequence of `context_len` positions and what is left
    for layers kept in RAM (the rest read from disk each step)."""
    lines = [f"fixed overhead {overhead.describe()}: RSS beside any budget"]
    if ram_bytes is None:
        return [*lines, "no RAM budget given (--cpu-memory-gb GIB bounds peak RSS to GIB + it)"]
    kv = shape.kv_bytes(1, context_len)
    lines.append(
        f"RAM budget {format_bytes(ram_bytes)} (--cpu-memory-gb): peak RSS within "
        f"{format_bytes(ram_bytes + overhead.total_bytes)}; it holds the layers' weights in "
        f"RAM, the slots, the KV cache ({format_bytes(kv)} a sequence of {context_len} "
        f"positions) and activations ({format_bytes(shape.activation_bytes)})"
    )
    whole = RamUse(sum(shape.layer_bytes), 0, kv, shape.activation_bytes)
    if whole.total_bytes <= ram_bytes:
        return [*lines, f"every layer fits in it resident ({whole.describe()})"]
    if least_ram(shape, 1, context_len).total_bytes > ram_bytes:
        return [*lines, str(ram_budget_error(shape, ram_bytes, 1, context_len))]
    room = ram_bytes - kv - shape.activation_bytes - MARGIN_BYTES
    budget_gb = hundredths(ram_bytes / GIB, math.floor)
    streamed = prefetch_within(shape, 1, 1, 1, room, DiskIO.DIRECT, budget_gb)
    use = ram_use(shape, streamed, kv)
    return [
        *lines,
        f"every layer resident needs {format_bytes(whole.total_bytes)}: with every layer "
        f"offloaded it keeps {format_bytes(streamed.host_bytes)} of them in RAM and reads "
        f"{format_bytes(streamed.disk_bytes)} from disk each step ({use.describe()})",
    ]


def overhead_without_tokenizer(shape: ModelShape) -> FixedOverhead:
    """`overhead.fixed_overhead` of a model of `shape` with no tokenizer counted (what a
    plan made from numbers alone can state; `offload plan` states the tokenizer too)."""
    return FixedOverhead(PROCESS_BASELINE_BYTES, shape.outside_bytes, 0)
