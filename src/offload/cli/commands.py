"""What `offload generate`, `offload inspect` and `offload bench` do (the parsing is in
`main.py`)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TextIO

import torch

from offload.api import OffloadPlan, plan
from offload.cli.defaults import whole_stack_config
from offload.cli.models import llm_arguments, llm_of, spec_of
from offload.cli.options import QUESTION
from offload.config import Backend, OffloadConfig
from offload.engine import cpu_step
from offload.engine.sampling_params import SamplingParams
from offload.engine.transfer_stats import TransferStats
from offload.errors import ConfigError, ModelError
from offload.llm.auto import planner_for
from offload.llm.fit import plan_memory
from offload.llm.llm import LLM
from offload.llm.streaming import TextStream
from offload.memory.placement import AUTO, DiskIO, Placement
from offload.offloader.layers import find_layer_stacks
from offload.planner.budget import describe_budget
from offload.planner.fit import device_budget, kv_cache_bytes, model_len_limit
from offload.planner.overhead import fixed_overhead
from offload.planner.shape import shape_of
from offload.probes.host import process_memory_bytes
from offload.quant.quantized import stored_form
from offload.sizes import GIB, compute_dtype, format_bytes, parameter_bytes

# The `generate` flags that are SamplingParams fields of the same name.
_SAMPLING_FLAGS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "max_tokens",
)


# On a CPU an answer of fewer decode steps runs eagerly: a kept compiled step takes ~4 s
# to load (a new one a minute or two to compile) and saves ~28 ms a step (the default
# model: 57 against 29 ms), and loaded beside the decode it slowed the eager steps 3x
# (docs/benchmarks.md, "the CLI's short answers eager").
EAGER_STEPS = 160


def generate(args: argparse.Namespace, out: TextIO | None = None) -> None:
    """Load, generate and write the answers (streamed when there is one) and a line of
    figures to `out` (default: stdout)."""
    out = out or sys.stdout
    # Checked before the model loads: a bad flag costs nothing.
    params = SamplingParams(**{name: getattr(args, name) for name in _SAMPLING_FLAGS})
    show_progress = not args.no_progress and sys.stderr.isatty()
    config = OffloadConfig.from_cli_args(args)
    more = dict(
        progress=show_progress,
        swap_space=args.swap_space,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_offload=args.kv_offload,
        enforce_eager=args.enforce_eager,
        batch_invariant=args.batch_invariant or None,  # (unset: VLLM_BATCH_INVARIANT decides)
    )
    llm_arguments(args, config, **more)  # (checked before the model is read)
    spec = spec_of(args, args.model, config)
    if config.selected_backend == Backend.NONE and not args.no_offload:
        config = whole_stack_config(spec.empty)
    if spec.device.type == "cpu" and (params.max_tokens or EAGER_STEPS) < EAGER_STEPS:
        more["enforce_eager"] = True  # (a short answer: no compiled step to load or make)
    llm = llm_of(args, spec, config, **more)
    # With no prompt, the default question goes through the chat template, if there is one.
    chat = args.chat or (not args.prompt and bool(getattr(llm.tokenizer, "chat_template", None)))
    prompts = args.prompt or [QUESTION]
    # One answer streams as it is generated; several are written whole, each labelled.
    stream = TextStream(_writer(out), params.stop_strings)
    streaming = not args.no_stream and len(prompts) == 1
    before = llm.transfer_stats()
    started = time.perf_counter()
    with llm._streaming(lambda sequences: stream.update(sequences[0].text) if streaming else None):
        if chat:
            messages = [[{"role": "user", "content": p}] for p in prompts]
            outputs = llm.chat(messages, params, use_tqdm=show_progress and not streaming)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=show_progress and not streaming)
    seconds = time.perf_counter() - started
    if len(prompts) == 1:
        stream.finish(outputs[0].outputs[0].text)
        out.write("\n")
    else:
        for number, (prompt, output) in enumerate(zip(prompts, outputs, strict=True), 1):
            out.write(f"--- prompt {number}: {_short(prompt)}\n{output.outputs[0].text}\n")
    out.write(_figures(llm, outputs, before, seconds) + "\n")
    out.flush()
    llm.wait_for_compiles(loads=False)  # (a step still compiling: kept for the next run)


def bench(args: argparse.Namespace, out: TextIO | None = None) -> None:
    """Run the methods on the workload, write the table to `out` (default: stdout) and
    save the JSON and PNG into `args.out`."""
    from offload.bench import Workload, report, run_bench

    out = out or sys.stdout
    # Checked before anything loads or is measured: a bad flag costs nothing.
    workload = Workload(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        batch_sizes=tuple(args.batch_sizes),
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        rounds=args.rounds,
    )
    show_progress = not args.no_progress and sys.stderr.isatty()
    result = run_bench(workload, args.methods, progress=show_progress)
    out.write(report.table(result, wide=args.wide) + "\n")
    for path in report.save(result, Path(args.out)):
        out.write(f"saved {path}\n")


def _writer(out: TextIO):
    def write(text: str) -> None:
        out.write(text)
        out.flush()

    return write


def _short(prompt: str, limit: int = 60) -> str:
    line = " ".join(prompt.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _figures(llm: LLM, outputs, before: TransferStats, seconds: float) -> str:
    this_call = llm.transfer_stats() - before
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    forwards = this_call.num_forwards
    weights = this_call.weight_copied_bytes / max(forwards, 1)
    kv = this_call.kv_moved_bytes / max(forwards, 1)
    stall = this_call.stall_s
    # Per forward, not per token: a prefill chunk moves the weights as a decode step does.
    moved = f"moved {format_bytes(weights + kv)}/forward over {forwards} forwards"
    if llm.kv_offload:
        moved += f" (weights {format_bytes(weights)}, KV cache {format_bytes(kv)})"
    if this_call.disk_read_bytes:
        moved += (
            f"; read {format_bytes(this_call.disk_read_bytes / max(forwards, 1))}/forward from "
            f"disk at {this_call.disk_read_gb_per_s:.2f} GB/s, I/O stall "
            f"{this_call.disk_stall_s * 1e3:.0f} ms"
        )
    if this_call.disk_mapped_bytes:  # disk_io mmap: the page cache is read in place
        mapped = this_call.disk_mapped_bytes / max(forwards, 1)
        moved += f"; computed on {format_bytes(mapped)}/forward of mapped checkpoint files"
    if this_call.num_spec_verifies:  # speculative decoding: what the guesses gave
        guessed, kept = this_call.num_spec_draft_tokens, this_call.num_spec_accepted_tokens
        moved += (
            f"; speculation kept {kept} of {guessed} guessed tokens over "
            f"{this_call.num_spec_verifies} verify forwards ({tokens / max(forwards, 1):.2f} "
            f"tokens/forward)"
        )
    # Said on the figures line: this run executed Python code shipped with the checkpoint.
    trusted = "; trust_remote_code=True" if llm.trust_remote_code else ""
    # The tokens/s of generating; a first compile is said apart (it is paid once).
    seconds -= this_call.compile_s
    compiling = f" (+ {this_call.compile_s:.1f} s compiling)" if this_call.compile_s else ""
    return (
        f"[{tokens} tokens in {seconds:.2f} s{compiling} on {llm.device}: "
        f"{tokens / seconds:.1f} tok/s; "
        f"offloaded {format_bytes(llm.offloader.offloaded_bytes)} "
        f"({type(llm.offloader).__name__}); "
        f"{moved}; stall {stall * 1e3:.0f} ms; {_memory(llm)}; "
        f"decode {_decode_mode(this_call)}{trusted}]"
    )


def _memory(llm: LLM) -> str:
    """The peak RSS so far beside what the budget rule allows it: cpu_memory_gb (on a
    CPU) plus the fixed overhead, which is stated either way (docs/guide.md, "Memory")."""
    peak_bytes = process_memory_bytes().get("peak_rss_bytes", 0)
    budget = llm.host_budget
    within = f"budget {budget.budget_bytes / GIB:.2f} GiB + " if budget is not None else ""
    return (
        f"peak RSS {peak_bytes / GIB:.2f} GiB ({within}fixed overhead "
        f"{llm.fixed_overhead.describe()})"
    )


def _decode_mode(this_call) -> str:
    if this_call.num_graph_replays:
        return f"in CUDA graphs ({this_call.num_graph_replays} replays)"
    if this_call.num_compiled_steps:
        return f"compiled ({this_call.num_compiled_steps} steps)"
    return "eager"  # (also while the compiled step was still being made in the background)


def inspected_model(args: argparse.Namespace) -> str | None:
    """The model `inspect` was given: `--model`, as every command takes it, or the
    positional MODEL; both only where they name the same one."""
    if args.path is not None and args.model is not None and args.path != args.model:
        raise ConfigError(
            f"the model is given twice, as MODEL {args.path!r} and --model {args.model!r}: "
            f"give one of them"
        )
    return args.model if args.model is not None else args.path


def inspect(args: argparse.Namespace) -> str:
    name = inspected_model(args)
    spec = spec_of(args, name, OffloadConfig(), shapes=True)
    path, model = spec.path, spec.empty
    total = parameter_bytes(model)
    dtype = compute_dtype(model)
    stored = stored_form(model.config)
    named = str(dtype).removeprefix("torch.")  # "float32", as plan and the flags say it
    held = f"{stored}, computing in {named}" if stored else named
    lines = [f"{path}: {type(model).__name__}, {format_bytes(total)} of parameters ({held})"]
    for name, stack in find_layer_stacks(model):
        sizes = [parameter_bytes(block) for block in stack]
        lines.append(
            f"  {name}: {len(sizes)} x {type(stack[0]).__name__}, {format_bytes(sum(sizes))} "
            f"(largest layer {format_bytes(max(sizes))})"
        )
    per_position = kv_cache_bytes(model.config, 1, dtype)
    limit = getattr(model.config, "max_position_embeddings", None)
    if per_position:
        lines.append(
            f"  KV cache: {format_bytes(per_position)} per position per sequence"
            + (f", {format_bytes(per_position * limit)} for {limit} positions" if limit else "")
            + " (--kv-offload / --swap-space keeps it in host memory)"
        )
    else:
        lines.append("  KV cache: none (no attention heads)")
    config = OffloadConfig.from_cli_args(args)
    device = spec.device
    lines += _budget_lines(path, model, config, device, args)
    fits, config, planned = _what_fits(path, model, config, device, args)
    lines.append(fits)
    if config.selected_backend == Backend.NONE:
        on_host = device.type == "cpu" and args.device_memory_gb is None
        lines.append(
            "no offloading configured (add e.g. --cpu-memory-gb 4: layers beyond 4 GiB of RAM "
            "stream from the checkpoint's files)"
            if on_host  # (the device is the host's RAM: moving weights to it frees nothing)
            else "no offloading configured (add e.g. --cpu-offload-gb 4 or --offload-group-size 8)"
        )
        return "\n".join(lines)
    planned = planned or plan(model, config, device)  # (the fit check's, where it fits)
    manifest, offloader = planned.params, planned.offloader
    modules = list(dict.fromkeys(e.module for e in manifest))
    lines.append(
        f"{config.selected_backend} would offload {format_bytes(planned.offloaded_bytes)} "
        f"({len(manifest)} parameters of {len(modules)} modules: {_ranges(modules)}); "
        f"{format_bytes(total - planned.offloaded_bytes)} stays on {device}"
    )
    if config.selected_backend == Backend.PREFETCH:
        lines.append(
            f"device staging: {offloader.prefetch_step} slot(s) of {offloader.unit} units, "
            f"{format_bytes(planned.staging_bytes)} in all"
        )
    if config.disk.is_active:
        streamed = sum(e.num_bytes for e in manifest if e.location == Placement.DISK)
        kept = planned.offloaded_bytes - streamed
        how = (
            "computed on in place (mapped) from"
            if offloader.disk_io == DiskIO.MMAP
            else "read from"
        )
        budget = f"cpu_memory_gb {config.disk.cpu_memory_gb}"
        if not streamed:  # (the disk tier then picks no I/O mode)
            lines.append(f"disk tier: every offloaded layer fits host memory ({budget})")
        else:
            lines.append(
                f"disk tier ({offloader.disk_io} io): {format_bytes(streamed)} {how} the "
                f"checkpoint's files per forward, {format_bytes(kept)} kept in host memory "
                f"({budget})"
            )
    return "\n".join(lines)


def _budget_lines(
    path: Path, model, config: OffloadConfig, device: torch.device, args
) -> list[str]:
    """On a CPU, the budget rule for this model: the fixed overhead and what a
    `--cpu-memory-gb` budget holds (as `offload plan` counts it)."""
    if device.type != "cpu" or args.device_memory_gb is not None:
        return []  # (a device of its own, or an emulated one: budgets apart)
    context_len = args.max_model_len or model_len_limit(model.config)
    shape = shape_of(model, context_len)
    ram_bytes = int(config.disk.cpu_memory_gb * GIB) if config.disk.is_active else None
    compiles = cpu_step.may_compile(device, getattr(args, "enforce_eager", False))
    overhead = fixed_overhead(model, path if path.is_dir() else None, compiles=compiles)
    return [f"  {line}" for line in describe_budget(shape, overhead, ram_bytes, context_len)]


def _what_fits(
    path: Path, model, config: OffloadConfig, device: torch.device, args
) -> tuple[str, OffloadConfig, OffloadPlan | None]:
    """Whether `config` fits the device budget, and if not what would (no weights read);
    the config with cpu_offload_gb='auto' resolved (as `LLM` does); its dry run if it fits."""
    limit = args.max_model_len or model_len_limit(model.config)
    budget = device_budget(device, args.gpu_memory_utilization, args.device_memory_gb)
    where = f"{device} budget {format_bytes(budget)} (max_model_len {limit})"
    planned = planner_for(
        path,
        model,
        config,
        device,
        gpu_memory_utilization=args.gpu_memory_utilization,
        device_memory_gb=args.device_memory_gb,
        kv_offload=False,
        trust_remote_code=args.trust_remote_code,
    )
    try:
        memory = plan_memory(
            model,
            config,
            device,
            max_model_len=args.max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization,
            device_memory_gb=args.device_memory_gb,
            max_num_batched_tokens=None,
            kv_offload=False,
            swap_space_bytes=0,
            planned=planned,
        )
    except ModelError as error:
        if config.uva.cpu_offload_gb == AUTO:
            raise
        return f"does not fit the {where}: {error}", config, None
    resolved, planned = memory.config, memory.dry_run
    if resolved.selected_backend == Backend.NONE:
        needed = format_bytes(memory.needs.total)
        return f"fits the {where} without offloading: {needed} needed", resolved, planned
    chosen = ""
    if memory.planned:
        chosen = " (the planner's choice)"
    elif config != resolved:
        chosen = f" (cpu_offload_gb={resolved.uva.cpu_offload_gb:g})"
    return f"fits the {where} with this offloading{chosen}", resolved, planned


def _ranges(modules: list[str]) -> str:
    shown = ", ".join(modules[:4])
    return shown + (f", ... {modules[-1]}" if len(modules) > 4 else "")
