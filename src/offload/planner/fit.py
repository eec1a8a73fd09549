"""Does the model fit? Arithmetic only: the device memory needed for weights, KV cache
and activations (`MemoryNeeds`), the device budget, the smallest offload that fits, and
the one message, with the numbers and the fix, where it does not. `offload.llm.fit`
measures a model built on the meta device and checks an offloader's plan with these."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from offload.config.validate import gib, integer, real
from offload.errors import ModelError
from offload.memory.host import meminfo_bytes
from offload.memory.kv_shape import kv_shape_of
from offload.sizes import GIB

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


def model_len_limit(hf_config) -> int:
    """The most positions a model takes: its config's, else 2048."""
    return getattr(hf_config, "max_position_embeddings", None) or 2048


def checked_context_len(name: str, value: object, limit: int) -> int:
    """A context length (`max_model_len`, `context_len`) the model takes: in [1, `limit`]."""
    return integer(name, value, 1, limit, what=f"in [1, {limit}] for this model")
