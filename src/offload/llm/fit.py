"""Does this model fit, with this config? Checked before anything is loaded: the model
built on the meta device is measured (`needs_of`), the offloader a config selects plans
(a dry run, no memory allocated) what it moves off the device, and the planner's arithmetic
(`offload.planner.fit`) says whether the rest fits the device budget; and the host memory
that `swap_space` and the KV cache in host memory may take. The offloader that planned is
the one the load wraps the model with (`MemoryPlan.for_load`): it is built once."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import torch
from torch import nn

from offload.api import OffloadPlan, plan
from offload.config import OffloadConfig
from offload.config.validate import gib
from offload.errors import ConfigError, ModelError
from offload.memory.host import available_ram_bytes
from offload.memory.kv_shape import KV_SLOTS
from offload.memory.placement import AUTO
from offload.offloader.layers import find_layer_stacks
from offload.planner.fit import (
    MemoryNeeds,
    activation_bytes,
    check_fit,
    checked_context_len,
    device_budget,
    kv_cache_bytes,
    model_len_limit,
    smallest_offload_gb,
)
from offload.sizes import GIB, compute_dtype


def needs_of(model: nn.Module, max_model_len: int, chunk_tokens: int | None = None) -> MemoryNeeds:
    """The needs of a model built on the meta device (no weights read), with prompts
    prefilled `chunk_tokens` at a time (None: whole)."""
    dtype = compute_dtype(model)
    stacks = [stack for _, stack in find_layer_stacks(model)]
    layers = [
        sum(p.numel() * p.element_size() for p in block.parameters()) for s in stacks for block in s
    ]
    return MemoryNeeds(
        weights=sum(p.numel() * p.element_size() for p in model.parameters()),
        layer_stack=sum(layers),
        largest_layer=max(layers, default=0),
        kv_cache=kv_cache_bytes(model.config, max_model_len, dtype),
        activations=activation_bytes(model.config, max_model_len, dtype, chunk_tokens),
    )


def plan_fit(
    empty,
    config: OffloadConfig,
    needs: MemoryNeeds,
    budget: int,
    device,
    kv_offload: bool,
    host_room: int | None = None,
) -> tuple[OffloadConfig, OffloadPlan]:
    """Resolve cpu_offload_gb='auto' and check, before loading, that the plan fits; the
    config and its offloader's plan (the bytes it moves to host memory). ('auto' here is
    the smallest UVA amount that fits; where only budgets are given, `LLM` first tries the
    planner's ranked configs, see `plan_memory` and `offload.llm.auto`.)"""
    if config.uva.cpu_offload_gb == AUTO:
        smallest = smallest_offload_gb(needs, budget)
        if smallest is None:
            # Raises, with the numbers.
            check_fit(needs, budget, needs.weights - needs.layer_stack, not kv_offload)
        config = replace(config, uva=replace(config.uva, cpu_offload_gb=smallest))
    planned = plan(empty, config, device)
    resident = needs.weights - planned.offloaded_bytes + planned.staging_bytes
    check_fit(needs, budget, resident, not kv_offload, host_room)
    return config, planned


class MemoryPlan(NamedTuple):
    """What `plan_memory` settled: the context length, the device bytes it needs, the
    config (cpu_offload_gb='auto' resolved), whether a planner ranked configs for it, and
    the plan of the offloader that config selects, on the model built on the meta device."""

    max_model_len: int
    needs: MemoryNeeds
    config: OffloadConfig
    planned: bool
    dry_run: OffloadPlan

    @property
    def offloaded_bytes(self) -> int:
        return self.dry_run.offloaded_bytes

    def for_load(self) -> OffloadPlan | None:
        """The plan the load carries out, with its offloader (built once, here); None
        where the load builds its own: with a disk tier, whose offloader is made from the
        checkpoint's byte ranges as the loader matches them to the model, and given the
        process budget that this plan's numbers set (`llm/budget.py`)."""
        return None if self.config.disk.is_active else self.dry_run


def plan_memory(
    empty: nn.Module,
    config: OffloadConfig,
    device: torch.device,
    *,
    max_model_len: int | None,
    gpu_memory_utilization: float,
    device_memory_gb: float | None,
    max_num_batched_tokens: int | None,
    kv_offload: bool,
    swap_space_bytes: int,
    planned: Callable[[int], list[OffloadConfig]] | None = None,
) -> MemoryPlan:
    """Check, with the model built on the meta device (no weights read), that the plan
    fits the device budget (see `device_budget`) and the host's RAM; `max_model_len`
    None is the model's own limit. `planned`, given the context length, ranks configs to
    run instead of `config` (the planner's, fastest first): the first that fits is run,
    and `config` where none does."""
    limit = model_len_limit(empty.config)
    if max_model_len is not None:
        max_model_len = checked_context_len("max_model_len", max_model_len, limit)
    max_model_len = max_model_len or limit
    budget_bytes = device_budget(device, gpu_memory_utilization, device_memory_gb)
    needs = needs_of(empty, max_model_len, max_num_batched_tokens)
    if kv_offload:  # the device holds only the slots: two layers' keys and values
        layers = empty.config.num_hidden_layers
        needs = replace(needs, kv_cache=min(KV_SLOTS, layers) * needs.kv_cache // layers)
    ranked = planned(max_model_len) if planned is not None else []
    # RAM that offloaded weights could take: none where the device is the host's RAM.
    room = 0 if device.type == "cpu" and device_memory_gb is None else available_ram_bytes()
    configs = [*ranked, config]
    config, dry_run = first_fit(empty, configs, needs, budget_bytes, device, kv_offload, room)
    check_host_room(swap_space_bytes, dry_run.offloaded_bytes)
    return MemoryPlan(max_model_len, needs, config, bool(ranked), dry_run)


def first_fit(
    empty,
    configs: list[OffloadConfig],
    needs: MemoryNeeds,
    budget: int,
    device,
    kv_offload: bool,
    host_room: int | None = None,
) -> tuple[OffloadConfig, OffloadPlan]:
    """`plan_fit` of the first of `configs` that fits; the last one's error where none
    does (the planner's ranked configs, then the user's own: its error is the one to
    show)."""
    for config in configs[:-1]:
        try:
            return plan_fit(empty, config, needs, budget, device, kv_offload, host_room)
        except ModelError:  # the engine counts memory to the byte: the planner's next
            continue
    return plan_fit(empty, configs[-1], needs, budget, device, kv_offload, host_room)


def check_swap_space(swap_space: object) -> int:
    """`swap_space` GiB as bytes, refused (before anything is allocated) when not a finite
    number, negative or larger than the RAM available now."""
    what = "a number of GiB (finite, >= 0)"  # the range is the RAM's, said below
    swap_space = gib("swap_space", swap_space, -math.inf, what=what)
    available = available_ram_bytes()
    if not 0 <= swap_space * GIB <= available:
        raise ConfigError(
            f"swap_space={swap_space:g} GiB is not possible: it must be between 0 and the "
            f"{available / GIB:.2f} GiB of RAM available now"
        )
    return int(swap_space * GIB)


def check_host_room(swap_space_bytes: int, offloaded_weight_bytes: int) -> None:
    """Refuse, before loading, a `swap_space` that fits in RAM only without the weights
    that offloading will put there too."""
    available = available_ram_bytes()
    if swap_space_bytes and swap_space_bytes + offloaded_weight_bytes > available:
        raise ConfigError(
            f"swap_space={swap_space_bytes / GIB:g} GiB plus the "
            f"{offloaded_weight_bytes / GIB:.2f} GiB of offloaded weights is more than the "
            f"{available / GIB:.2f} GiB of RAM available now; lower swap_space or offload less"
        )
