"""The budget rule at run time (docs/guide.md, "Memory"): on a CPU, the device is the host's
RAM, and `cpu_memory_gb` (B) bounds the whole process beyond a stated fixed overhead
(`planner.overhead`). B is shared, in this order: the KV cache's share and a step's
activations first, then the layer stack (kept layers, slots, touched pages of mapped
files: the disk tier fits it, `offloader.disk_placement.fit_stack`); whatever the stack
leaves goes to the KV cache too (the server's rows), never RAM that is merely free.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from offload.errors import ModelError
from offload.offloader.disk_placement import StackRoomError
from offload.offloader.layers import find_layer_stacks
from offload.planner.fit import activation_bytes, kv_cache_bytes
from offload.sizes import GIB, MIB, compute_dtype, parameter_bytes

_logger = logging.getLogger("offload")

MARGIN_BYTES = 64 * MIB  # allocator slack, small kernels' workspaces


@dataclass(frozen=True)
class HostBudget:
    """`cpu_memory_gb` on a CPU, split (bytes)."""

    budget_bytes: int  # B
    kv_bytes: int  # the KV cache's share, set aside before the stack is placed
    kv_given: bool  # kv_cache_memory_bytes or swap_space said it (else one sequence)
    max_model_len: int
    activation_bytes: int
    resident_layer_bytes: int = 0  # layers of the stack a layout does not offload

    @property
    def stack_bytes(self) -> int:
        """What the offloaded layers may take: B less the KV cache, activations, margin
        and the stack's layers kept resident."""
        return self.budget_bytes - self.kv_bytes - self._others_bytes

    def kv_room(self, stack_ram_bytes: int) -> int:
        """The KV cache's bytes once the offloaded layers took `stack_ram_bytes`: the
        share given, else all they leave of B (at least the one sequence set aside)."""
        if self.kv_given:
            return self.kv_bytes
        return self.budget_bytes - stack_ram_bytes - self._others_bytes

    @property
    def _others_bytes(self) -> int:
        return self.activation_bytes + MARGIN_BYTES + self.resident_layer_bytes

    def refused(self, error: StackRoomError) -> ModelError:
        """The one-line error where B cannot hold the minimum, with what would fit."""
        kv = "given" if self.kv_given else f"one sequence of {self.max_model_len} positions"
        short = error.need_bytes - error.room_bytes
        fits = -(-(self.budget_bytes + short) * 100 // GIB) / 100
        resident = self.resident_layer_bytes
        return ModelError(
            f"cpu_memory_gb={self.budget_bytes / GIB:.2f} cannot hold the minimum: {error} "
            f"(after the KV cache, {self.kv_bytes / MIB:.0f} MiB: {kv}; activations, "
            f"{self.activation_bytes / MIB:.0f} MiB; margin, {MARGIN_BYTES / MIB:.0f} MiB"
            + (f"; layers not offloaded, {resident / MIB:.0f} MiB" if resident else "")
            + "); "
            f"cpu_memory_gb={fits:.2f} fits, as would a smaller "
            + ("KV cache share" if self.kv_given else "max_model_len")
        )


def host_budget_of(
    llm: Any,
    empty: nn.Module,
    offloaded_bytes: int,
    budget_gb: float | None,
    device_memory_gb: float | None,
) -> HostBudget | None:
    """The budget rule's split for `llm` (an `LLM` being made: its device, context length,
    chunk and KV settings) where it applies: a CPU that is the device (no emulated
    `device_memory_gb`) and a budget given (`budget_gb`: cpu_memory_gb > 0; 0 is no
    budget but "every layer streams from disk", the least RAM there is); else None. The
    KV cache's share: `kv_cache_memory_bytes`, else `swap_space`, else one sequence of
    `max_model_len` positions (the least a request may need). Layers of the stack that
    the layout leaves resident (beyond its `offloaded_bytes`) come out of B too."""
    if llm.device.type != "cpu" or device_memory_gb is not None or not budget_gb:
        return None
    stack = sum(parameter_bytes(b) for _, blocks in find_layer_stacks(empty) for b in blocks)
    dtype = compute_dtype(empty)
    given = llm.kv_cache_memory_bytes or llm.swap_space_bytes or None
    one_sequence = kv_cache_bytes(empty.config, llm.max_model_len, dtype)
    return HostBudget(
        budget_bytes=int(budget_gb * GIB),
        kv_bytes=given if given is not None else one_sequence,
        kv_given=given is not None,
        max_model_len=llm.max_model_len,
        activation_bytes=activation_bytes(
            empty.config, llm.max_model_len, dtype, llm.max_num_batched_tokens
        ),
        resident_layer_bytes=stack - offloaded_bytes,
    )


def kv_room_after(budget: HostBudget | None, offloader: Any) -> int | None:
    """The KV cache's room once `offloader` placed the layer stack (None: no budget)."""
    if budget is None:
        return None
    return budget.kv_room(offloader.stats().disk.ram_bytes)


MIN_FITTED_LEN = 256  # positions: the shortest context a budget is fitted down to


def shorter_power_of_two(length: int) -> int:
    """The longest power of two below `length`, at least `MIN_FITTED_LEN` (the next
    context tried when one does not fit a budget)."""
    return max(MIN_FITTED_LEN, 1 << ((length - 1).bit_length() - 1))


def shorter_context(
    empty: nn.Module, budget: HostBudget, error: StackRoomError, max_num_batched_tokens
) -> int | None:
    """The longest context (a power of two, at least `MIN_FITTED_LEN`) whose one sequence
    of KV cache and activations leave the layer stack what `error` says it lacks; None
    where the KV cache's share was given, or no such context is shorter."""
    if budget.kv_given:
        return None
    short_bytes = error.need_bytes - error.room_bytes
    dtype = compute_dtype(empty)
    held = budget.kv_bytes + budget.activation_bytes
    length = budget.max_model_len
    while length > MIN_FITTED_LEN:
        length = shorter_power_of_two(length)
        need = kv_cache_bytes(empty.config, length, dtype)
        need += activation_bytes(empty.config, length, dtype, max_num_batched_tokens)
        if held - need >= short_bytes:
            return length
    return None


def load_fitted(
    llm: Any,
    load: Callable[[], None],
    empty: nn.Module,
    offloaded_bytes: int,
    budgets: tuple[float | None, float | None],
    fit_len: bool,
) -> None:
    """`load()`; where the budget cannot hold the layer stack beside one sequence of the
    default context (`fit_len`: no max_model_len was asked for), once more with the longest
    context that leaves the stack its room (`shorter_context`), said in a log line.
    `budgets`: cpu_memory_gb and device_memory_gb, as `host_budget_of` takes them."""
    try:
        load()
    except ModelError as error:  # (`HostBudget.refused`, from the stack's own error)
        cause, shorter = error.__cause__, None
        if fit_len and isinstance(cause, StackRoomError) and llm.host_budget is not None:
            shorter = shorter_context(empty, llm.host_budget, cause, llm.max_num_batched_tokens)
        if shorter is None:
            raise
        _logger.warning(
            "max_model_len %d does not fit cpu_memory_gb=%s beside the layer stack: %d "
            "positions (set max_model_len to choose)",
            llm.max_model_len, budgets[0], shorter,
        )  # fmt: skip
        llm.max_model_len = shorter
        llm.host_budget = host_budget_of(llm, empty, offloaded_bytes, *budgets)
        load()
