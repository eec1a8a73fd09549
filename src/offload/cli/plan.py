"""What `offload plan` does (the parsing is in `main.py`): plan, then write the plan, its
flags, the prediction, the warnings and the best alternatives."""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from collections.abc import Collection, Sequence
from pathlib import Path

from offload.engine.speculative import SpeculativeConfig
from offload.errors import ConfigError
from offload.llm.auto import plan_for
from offload.memory.placement import AUTO
from offload.planner.choose import Candidate
from offload.planner.flags import kv_flags, offload_flags, vllm_flags, warnings_for
from offload.planner.plan import Plan
from offload.planner.speculation import Speculation, for_plan, weight_bytes_at
from offload.planner.stages import estimate_stages
from offload.sizes import format_bytes


def run_plan(args: argparse.Namespace, generate_flags: Collection[str] = ()) -> str:
    """Plan, and the plan for people (`generate_flags`: the flags `offload generate`
    takes, so that only those are printed)."""
    speculative = SpeculativeConfig.of(getattr(args, "speculative_config", None))
    draft_bytes = _draft_bytes(speculative)  # (a draft that is not there: refused first)
    plan = plan_for(
        args.model,
        args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        context_len=args.context_len,
        batch_size=args.batch_size,
        max_batch=args.max_batch,
        cpu_memory_gb=args.cpu_memory_gb,
        device_memory_gb=args.device_memory_gb,
        gpu_memory_utilization=args.gpu_memory_utilization,
        remeasure=args.remeasure,
        trust_remote_code=args.trust_remote_code,
        progress=_progress if sys.stderr.isatty() else None,  # (a terminal's: no log noise)
    )
    speculation = None
    if speculative is not None:
        speculation = speculative, *for_plan(plan, speculative.method, draft_bytes)
    text = describe(plan, _model_flags(args), generate_flags, speculation)
    size = getattr(args, "pipeline_parallel_size", 1)
    if size > 1:
        text += "\n" + "\n".join(pipeline_lines(plan, size))
    return text


def pipeline_lines(plan: Plan, size: int) -> list[str]:
    """What `size` pipeline ranks, each within the plan's RAM budget, are predicted to
    do (`planner.stages.estimate_stages`), beside the one process planned."""
    measured, shape = plan.measured.measurements, plan.shape
    # (on a CPU the "link" is the RAM the weights are read from)
    ram, disk, room = measured.link_gb_per_s, measured.disk_gb_per_s, plan.budgets.ram_bytes
    compute, use = plan.chosen.time.compute_s, plan.chosen.ram
    kv = use.kv_bytes if use is not None else 0
    if room is not None and use is not None:  # (less what is not weights but the KV cache)
        room -= use.activation_bytes + use.margin_bytes
    stages = estimate_stages(
        shape.layer_bytes, shape.outside_bytes, size, room, ram, disk, compute, kv
    )
    budget = plan.budgets.ram_bytes
    within = f"within {format_bytes(budget)} of RAM each" if budget is not None else "resident"
    lines = [f"pipeline of {size} ranks, {within} (stages take turns):"]
    for estimate in stages:
        layers = estimate.stage.layers
        head = " and the head" if estimate.stage.is_last else ""
        held = (
            f"{format_bytes(estimate.streamed_bytes)} of it streamed from disk"
            if estimate.streamed_bytes else "all in RAM"
        )  # fmt: skip
        lines.append(
            f"  rank {estimate.stage.rank}: layers {layers.start}-{layers.stop - 1}{head}, "
            f"{format_bytes(estimate.weight_bytes)} ({held}): {estimate.step_s * 1e3:.1f} ms a step"
        )
    step = sum(e.step_s for e in stages)
    batch = plan.batch_size
    lines.append(
        f"  predicted step {step * 1e3:.1f} ms, {batch / step:.1f} tokens/s at batch {batch} "
        f"(one process as planned: {prediction(plan.chosen)})"
    )
    lines.append(f"  flag: --pipeline-parallel-size {size}")
    return lines


def _draft_bytes(config: SpeculativeConfig | None) -> int:
    """The draft model's weight bytes (0: none, or n-gram lookup); one line where the
    draft named is no checkpoint here."""
    if config is None or config.model is None:
        return 0
    path = Path(config.model).expanduser()
    size = weight_bytes_at(path) if path.exists() else 0
    if not size:
        raise ConfigError(
            f"speculative_config: the draft model {config.model!r} is no checkpoint here "
            "(give a .gguf file or a folder of safetensors)"
        )
    return size


def speculation_lines(
    config: SpeculativeConfig, best: Speculation, weighed: list[Speculation]
) -> tuple[list[str], list[str]]:
    """What speculation is predicted to give on the plan (lines for people), and the
    flag that asks for it (none where it does not pay)."""
    kind = "n-gram lookup" if config.method == "ngram" else f"the draft {config.model}"
    shown = [s for s in weighed if s.k in (1, 2, 4, 8, 16)]
    lines = [
        f"speculative decoding by {kind}, taking {best.acceptance:.0%} of guesses kept "
        "where the one before was (the engine measures its own as it runs):",
        "  " + ", ".join(f"k={s.k} {s.speedup:.2f}x" for s in shown),
    ]
    if best.k == 0:
        lines.append("  not predicted to pay on this placement: leave it off")
        return lines, []
    lines.append(
        f"  chosen k={best.k}: {best.tokens_per_forward:.2f} tokens a forward, "
        f"{best.speedup:.2f}x the tokens/s of plain steps"
    )
    chosen = {"method": config.method, "num_speculative_tokens": best.k}
    for key in ("model", "quantization"):
        if getattr(config, key) is not None:
            chosen[key] = getattr(config, key)
    if config.tree_budget is not None:  # (weighed as a chain; kept as asked, at least k)
        chosen["tree_budget"] = max(config.tree_budget, best.k)
    return lines, ["--speculative-config", json.dumps(chosen)]


def _model_flags(args: argparse.Namespace) -> list[str]:
    """The flags that named what was planned (model, device, form), so that the flags
    printed run that plan as they are: `-q gguf` planned on a GPU runs converted without it."""
    flags = ["--model", args.model] if args.model else []
    if args.device != AUTO:
        flags += ["--device", args.device]
    if args.dtype != AUTO:
        flags += ["--dtype", args.dtype]
    if args.quantization:
        flags += ["--quantization", args.quantization]
    return flags + (["--trust-remote-code"] if args.trust_remote_code else [])


def _progress(part: str) -> None:
    print(f"offload plan: {part}...", file=sys.stderr, flush=True)


def describe(
    plan: Plan,
    model_flags: Sequence[str] = (),
    generate_flags: Collection[str] = (),
    speculation: tuple[SpeculativeConfig, Speculation, list[Speculation]] | None = None,
) -> str:
    """The plan for people: what was weighed, the choice, the flags (`model_flags` first:
    what was planned; the KV cache's size where `generate_flags` has its flag), the
    alternatives; and what `speculation` gives, where asked."""
    kv = kv_flags(plan)
    kv = kv if kv and kv[0] in generate_flags else []
    guessing, spec_flags = speculation_lines(*speculation) if speculation else ([], [])
    m = plan.measured.measurements
    # The form planned: a quantized model's weights as stored (computing in m.dtype).
    held = f"{plan.shape.stored}, computing in {m.dtype}" if plan.shape.stored else m.dtype
    lines = [
        f"plan for {plan.path} ({held}) on {m.device_type}, decoding with "
        f"{plan.context_len} positions of context:",
        *(f"  {reason}" for reason in plan.reasons),
        f"chosen: {plan.chosen.label}, batch {plan.batch_size}",
        f"  {prediction(plan.chosen)}",
        f"  memory: {memory(plan)}",
        *guessing,
        f"offload generate flags (with {plan.batch_size} "
        f"prompt{'s' if plan.batch_size != 1 else ''} a call):",
        f"  {shlex.join([*model_flags, *offload_flags(plan), *kv, *spec_flags])}",
    ]
    flags, missing = vllm_flags(plan)
    flags = [*flags, *spec_flags]  # (vLLM's flag of the same name and JSON)
    lines.append("vllm serve flags" + (" (for what vLLM can express):" if missing else ":"))
    lines.append(f"  {shlex.join(flags)}")
    if missing:
        lines.append(f"  vLLM has no equivalent of: {', '.join(missing)}")
    lines += [f"warning: {warning}" for warning in warnings_for(plan)]
    if plan.alternatives:
        lines.append("alternatives:")
        lines += [f"  {c.label}, batch {c.batch_size}: {prediction(c)}" for c in plan.alternatives]
    lines.append(_measured_line(plan))
    return "\n".join(lines)


def memory(plan: Plan) -> str:
    """What the chosen candidate takes: on the device and in host memory, or of a CPU's
    one budget, by kind, with the fixed overhead beside it."""
    chosen, ram_bytes = plan.chosen, plan.budgets.ram_bytes
    if chosen.ram is None or ram_bytes is None:
        return f"device {format_bytes(chosen.device_bytes)}, host {format_bytes(chosen.host_bytes)}"
    overhead = plan.overhead.total_bytes
    return (
        f"{format_bytes(chosen.ram.total_bytes)} of the {format_bytes(ram_bytes)} RAM budget "
        f"({chosen.ram.describe()}) and the fixed overhead {format_bytes(overhead)}: peak RSS "
        f"about {format_bytes(chosen.ram.total_bytes + overhead)}"
    )


def prediction(candidate: Candidate) -> str:
    t = candidate.time
    return (
        f"predicted step {t.step_s * 1e3:.2f} ms, {candidate.tokens_per_s:.1f} tokens/s "
        f"({t.limit}-bound: compute {t.compute_s * 1e3:.2f} ms, link {t.link_s * 1e3:.2f} ms, "
        f"disk {t.disk_s * 1e3:.2f} ms, stalls {t.stall_s * 1e3:.2f} ms)"
    )


def _measured_line(plan: Plan) -> str:
    measured = plan.measured
    when = measured.measurements.measured_at
    if measured.from_cache:
        return (
            f"measurements: cached {when}{_age(when)} in {measured.path} (--remeasure "
            "measures again)"
        )
    return f"measurements: taken now, cached in {measured.path}"


def _age(when: str) -> str:
    """ " (3 hours ago)" for an ISO time, or "" where it cannot be read."""
    try:
        then = datetime.datetime.fromisoformat(when)
    except (TypeError, ValueError):
        return ""
    seconds = (datetime.datetime.now(datetime.timezone.utc) - then).total_seconds()
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            count = int(seconds // size)
            return f" ({count} {unit}{'s' if count != 1 else ''} ago)"
    return " (just now)"
