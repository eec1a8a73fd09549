"""A plan as flags to paste: those of `offload generate` (ours, which reproduce the config
exactly) and those of `vllm serve` where vLLM can express the setting; and the warnings a
plan deserves."""

from __future__ import annotations

from typing import Any

from offload.config import Backend, OffloadConfig
from offload.config.flags import FLAG_DESTS, FLAG_NAMES
from offload.planner.choose import candidates
from offload.planner.plan import Plan

# vLLM's own offload flags (the others in config/flags.py are ours).
VLLM_DESTS = (
    "offload_backend",
    "cpu_offload_gb",
    "cpu_offload_params",
    "offload_group_size",
    "offload_num_in_group",
    "offload_prefetch_step",
    "offload_params",
)
KV_MEMORY_FLAG = "--kv-cache-memory-bytes"  # vLLM's, and the run's on a budget
TRANSFER_BOUND = 2.0  # a step this many times its compute is transfer-bound
NEARLY_FREE = 1.1  # a larger batch whose step is within 10% costs almost nothing more
_MAX_BATCH_TRIED = 1024


def config_values(config: OffloadConfig) -> dict[str, Any]:
    """The config's fields that differ from the defaults, as flag dests (in flag order);
    the backend always, so that the flags say which one runs."""
    given, default = _flat(config), _flat(OffloadConfig())
    return {
        dest: given[dest]
        for dest in FLAG_DESTS
        if given[dest] != default[dest]
        or (dest == "offload_backend" and given[dest] != Backend.AUTO)
    }


def _flat(config: OffloadConfig) -> dict[str, Any]:
    nested = config.to_dict()
    flat = {k: v for k, v in nested.items() if not isinstance(v, dict)}
    for part in ("uva", "prefetch", "disk"):
        flat.update(nested[part])
    return flat


def as_flags(values: dict[str, Any]) -> list[str]:
    flags: list[str] = []
    for dest, value in values.items():
        flag = FLAG_NAMES[dest]
        if value is True:  # a switch
            flags.append(flag)
        elif isinstance(value, list):
            flags += [flag, *value]
        elif isinstance(value, float):
            flags += [flag, str(int(value)) if value.is_integer() else repr(value)]
        else:
            flags += [flag, str(value)]
    return flags


def offload_flags(plan: Plan) -> list[str]:
    """Flags of `offload generate` that run the plan (with `batch_size` prompts a call)."""
    flags = as_flags(config_values(plan.config))
    if plan.kv_offload:
        flags.append("--kv-offload")
    return [*flags, "--max-model-len", str(plan.context_len)]


def kv_flags(plan: Plan) -> list[str]:
    """On a CPU's one budget, the KV cache the plan counts, as the run is told it (vLLM's
    `--kv-cache-memory-bytes`): unless told, a run on a budget sets aside one sequence's,
    keeps more layers in what is left and decodes fewer prompts at once than planned."""
    if plan.budgets.ram_bytes is None or plan.batch_size == 1:
        return []
    kv_bytes = plan.shape.kv_bytes(plan.batch_size, plan.context_len)
    return [KV_MEMORY_FLAG, str(kv_bytes)]


def vllm_flags(plan: Plan) -> tuple[list[str], list[str]]:
    """Flags of `vllm serve` for what vLLM can express, and what it cannot (one phrase
    each: the reader runs ours for those)."""
    values = config_values(plan.config)
    flags = as_flags({d: v for d, v in values.items() if d in VLLM_DESTS})
    flags += ["--max-num-seqs", str(plan.batch_size), "--max-model-len", str(plan.context_len)]
    flags += kv_flags(plan)
    missing = [f"{FLAG_NAMES[d]} (ours)" for d in values if d not in VLLM_DESTS]
    if plan.kv_offload:
        missing.append("the KV cache in host memory (--kv-offload)")
    return flags, missing


def warnings_for(plan: Plan) -> list[str]:
    """ "The model fits" when nothing is offloaded; "transfer-bound" when the step is far
    above its compute and a larger batch would cost almost nothing more."""
    chosen = plan.chosen
    if not chosen.layout.offloaded_bytes and not chosen.kv_offload:
        return ["the model fits: no offloading needed"]
    ratio = chosen.time.step_s / chosen.time.compute_s if chosen.time.compute_s else 0.0
    if ratio < TRANSFER_BOUND:
        return []
    larger = _nearly_free_batch(plan)
    hint = (
        f"batch {larger} would cost almost nothing more"
        if larger
        else "a larger batch would cost little more, but none fits the budgets"
    )
    return [f"transfer-bound: step is {ratio:.1f}x compute; {hint}"]


def _nearly_free_batch(plan: Plan) -> int | None:
    """The largest power-of-two multiple of the batch whose best placement's predicted
    step is within `NEARLY_FREE` of the chosen one's (compute beyond the measured batch
    sizes scaled with the batch)."""
    chosen, best = plan.chosen, None
    batch = chosen.batch_size * 2
    while batch <= _MAX_BATCH_TRIED:
        found = candidates(plan.shape, plan.measured.measurements, plan.budgets, [batch])
        if not found or found[0].time.step_s > NEARLY_FREE * chosen.time.step_s:
            break
        best, batch = batch, batch * 2
    return best
