"""Does the model fit? Device memory needed for weights, KV cache and activations,
against the budget, before anything is loaded; the smallest offload that fits; and the
host memory that `swap_space` and the KV cache in host memory may take."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch import nn

from offload.api import plan
from offload.config import OffloadConfig
from offload.config.validate import gib, integer, real
from offload.errors import ConfigError, ModelError
from offload.memory.host import available_ram_bytes, meminfo_bytes
from offload.memory.kv_shape import KV_SLOTS, kv_shape_of
from offload.offloader.layers import find_layer_stacks
from offload.sizes import GIB, compute_dtype

MARGIN_BYTES = 64 * 2**20  # allocator slack, small kernels' workspaces


@dataclass(frozen=True)
class MemoryNeeds:
    """Device bytes a model needs to serve `max_model_len` tokens, by kind."""

    weights: int
    layer_stack: int  # the part of `weights` an offloader may move to host memory
    largest_layer: int
    kv_cache: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations + MARGIN_BYTES


def kv_cache_bytes(hf_config, max_model_len: int, dtype: torch.dtype, batch: int = 1) -> int:
    """Keys and values of every layer for `max_model_len` tokens (0 for a model without
    attention heads, such as a state-space model: it keeps no KV cache)."""
    if getattr(hf_config, "num_attention_heads", None) is None:
        return 0
    shape = kv_shape_of(hf_config, batch, max_model_len, dtype)
    return hf_config.num_hidden_layers * shape.layer_bytes


def activation_bytes(
    hf_config, max_model_len: int, dtype: torch.dtype, chunk_tokens: int | None = None
) -> int:
    """A prefill through one layer (hidden states, the MLP's intermediate, attention
    scores of one head at a time) and the last token's logits: of `max_model_len`
    tokens, or of a chunk of `chunk_tokens` against a cache of `max_model_len`."""
    hidden = hf_config.hidden_size
    intermediate = getattr(hf_config, "intermediate_size", 4 * hidden)
    per_token = 4 * hidden + 3 * intermediate
    tokens = min(max_model_len, chunk_tokens or max_model_len)
    scores = tokens * max_model_len
    return (tokens * per_token + scores) * dtype.itemsize + hf_config.vocab_size * 4


def measure(model: nn.Module, max_model_len: int, chunk_tokens: int | None = None) -> MemoryNeeds:
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


def check_budget_args(
    gpu_memory_utilization: object, device_memory_gb: object
) -> tuple[float, float | None]:
    """The device budget's two settings, checked: a share of the device's memory in
    (0, 1], and the GiB of an emulated device (None: the real one)."""
    share = real("gpu_memory_utilization", gpu_memory_utilization, 0, 1, low_open=True, finite=True)
    if device_memory_gb is None:
        return share, None
    what = "a positive, finite number of GiB"
    return share, gib("device_memory_gb", device_memory_gb, low_open=True, what=what)


def device_budget(
    device: torch.device, gpu_memory_utilization: float, device_memory_gb: float | None
) -> int:
    """Bytes the model may use on `device`: `gpu_memory_utilization` of the device's
    memory (`device_memory_gb` emulates a smaller device, e.g. on the CPU)."""
    share, device_memory_gb = check_budget_args(gpu_memory_utilization, device_memory_gb)
    if device_memory_gb is not None:
        total = device_memory_gb * GIB
    elif device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        # A cap set with torch.cuda.set_per_process_memory_fraction is a smaller device.
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        # (it takes an index: a bare "cuda" is the current device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        total *= get_fraction(index) if get_fraction is not None else 1.0
    else:
        total = meminfo_bytes("MemTotal") or 2**63
    return int(total * share)


def smallest_offload_gb(needs: MemoryNeeds, budget: int) -> float | None:
    """The smallest `cpu_offload_gb` that fits (0 if it fits already; None if even the
    whole layer stack offloaded is not enough). Rounded up to 0.01 GiB."""
    excess = needs.total - budget
    if excess <= 0:
        return 0.0
    # The UVA budget check runs before each parameter, so up to one more parameter may go;
    # asking for `excess` therefore offloads at least `excess`.
    if excess > needs.layer_stack:
        return None
    return math.ceil(excess / GIB * 100) / 100


def check_fit(
    needs: MemoryNeeds,
    budget: int,
    resident_weights: int,
    kv_on_device: bool = True,
    host_room: int | None = None,
) -> None:
    """Raise one clear message, with the numbers and the fix, if it does not fit.
    `host_room`: the bytes of RAM that weights moved off the device could take (0 where
    the device is the host's own RAM; None: not checked). Where offloading would need more
    than that, the fix said is the disk tier."""
    need = resident_weights + needs.kv_cache + needs.activations + MARGIN_BYTES
    if need <= budget:
        return
    if host_room is not None:
        _check_host_fits(needs, budget, host_room)
    numbers = (
        f"needs {need / GIB:.2f} GiB on the device (weights {resident_weights / GIB:.2f}, "
        f"KV cache {needs.kv_cache / GIB:.2f}, activations {needs.activations / GIB:.2f}) "
        f"but the budget is {budget / GIB:.2f} GiB"
    )
    smallest = smallest_offload_gb(needs, budget)
    kv_fix = (
        "; the KV cache can also live in host memory (kv_offload=True or --swap-space)"
        if kv_on_device and needs.kv_cache
        else ""
    )
    if smallest is None:
        raise ModelError(
            f"the model does not fit even with every layer offloaded: it {numbers}; "
            f"lower max_model_len or raise gpu_memory_utilization{kv_fix}; a smaller "
            f"max_num_batched_tokens (--max-num-batched-tokens) prefills in chunks and needs "
            f"fewer activations"
        )
    raise ModelError(
        f"the model does not fit: it {numbers}; --cpu-offload-gb {smallest:.2f} (or "
        f"cpu_offload_gb='auto') makes it fit, as would --offload-group-size 1 "
        f"--offload-prefetch-step 2 if {2 * needs.largest_layer / GIB:.2f} GiB of staging "
        f"fits{kv_fix}"
    )


def _check_host_fits(needs: MemoryNeeds, budget: int, host_room: int) -> None:
    """The disk tier as the fix, where what must leave the device does not fit in RAM."""
    smallest = smallest_offload_gb(needs, budget)
    if smallest is None or smallest * GIB <= host_room:
        return
    rest = needs.weights - needs.layer_stack + needs.kv_cache + needs.activations + MARGIN_BYTES
    if host_room == 0:  # the device is this machine's RAM: every weight is in it
        keep = math.floor(max(budget - rest, 0) / GIB * 100) / 100
        ram = needs.weights + needs.kv_cache + needs.activations + MARGIN_BYTES
        raise ModelError(
            f"the model does not fit this machine's RAM: it needs {ram / GIB:.2f} GiB "
            f"(weights {needs.weights / GIB:.2f}, "
            f"KV cache {needs.kv_cache / GIB:.2f}, activations {needs.activations / GIB:.2f}) "
            f"but the budget is {budget / GIB:.2f} GiB; the disk tier keeps {keep:.2f} GiB of "
            f"layers in RAM and streams the others from the checkpoint's files each step: "
            f"--cpu-memory-gb {keep:.2f} (cpu_memory_gb={keep:.2f})"
        )
    keep = math.floor(host_room * 0.8 / GIB * 100) / 100  # (room for the rest of the host)
    raise ModelError(
        f"the model does not fit: {smallest:.2f} GiB of weights would have to leave the "
        f"device, more than the {host_room / GIB:.2f} GiB of RAM available; the disk tier "
        f"keeps what RAM holds and streams the other layers from the checkpoint's files "
        f"each step: --cpu-memory-gb {keep:.2f} --offload-group-size 1 --offload-prefetch-step 2"
    )


def plan_fit(
    empty,
    config: OffloadConfig,
    needs: MemoryNeeds,
    budget: int,
    device,
    kv_offload: bool,
    host_room: int | None = None,
) -> tuple[OffloadConfig, int]:
    """Resolve cpu_offload_gb='auto' and check, before loading, that the plan fits; the
    config and the bytes it moves to host memory. ('auto' here is the smallest UVA amount
    that fits; where only budgets are given, `LLM` first tries the planner's ranked configs,
    see `plan_memory` and `offload.llm.auto`.)"""
    if config.uva.cpu_offload_gb == "auto":
        smallest = smallest_offload_gb(needs, budget)
        if smallest is None:
            # Raises, with the numbers.
            check_fit(needs, budget, needs.weights - needs.layer_stack, not kv_offload)
        config = replace(config, uva=replace(config.uva, cpu_offload_gb=smallest))
    planned = plan(empty, config, device)
    resident = needs.weights - planned.offloaded_bytes + planned.staging_bytes
    check_fit(needs, budget, resident, not kv_offload, host_room)
    return config, planned.offloaded_bytes


def model_len_limit(hf_config) -> int:
    """The most positions a model takes: its config's, else 2048."""
    return getattr(hf_config, "max_position_embeddings", None) or 2048


def checked_context_len(name: str, value: object, limit: int) -> int:
    """A context length (`max_model_len`, `context_len`) the model takes: in [1, `limit`]."""
    return integer(name, value, 1, limit, what=f"in [1, {limit}] for this model")


class MemoryPlan(NamedTuple):
    """What `plan_memory` settled: the context length, the device bytes it needs, the
    config (cpu_offload_gb='auto' resolved) and whether a planner ranked configs for it."""

    max_model_len: int
    needs: MemoryNeeds
    config: OffloadConfig
    planned: bool


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
    needs = measure(empty, max_model_len, max_num_batched_tokens)
    if kv_offload:  # the device holds only the slots: two layers' keys and values
        layers = empty.config.num_hidden_layers
        needs = replace(needs, kv_cache=min(KV_SLOTS, layers) * needs.kv_cache // layers)
    ranked = planned(max_model_len) if planned is not None else []
    # RAM that offloaded weights could take: none where the device is the host's RAM.
    room = 0 if device.type == "cpu" and device_memory_gb is None else available_ram_bytes()
    configs = [*ranked, config]
    config, offloaded = first_fit(empty, configs, needs, budget_bytes, device, kv_offload, room)
    check_host_room(swap_space_bytes, offloaded)
    return MemoryPlan(max_model_len, needs, config, bool(ranked))


def first_fit(
    empty,
    configs: list[OffloadConfig],
    needs: MemoryNeeds,
    budget: int,
    device,
    kv_offload: bool,
    host_room: int | None = None,
) -> tuple[OffloadConfig, int]:
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
