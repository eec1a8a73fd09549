"""Loading an `LLM`: its tokenizer, its model with the offloader in place (the one the
fit check planned with, `MemoryPlan.for_load`), and the state its decode loop keeps
between calls (`LLM.__init__` calls it through `budget.load_fitted`, which may call it
again with a shorter context)."""

from __future__ import annotations

import functools
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from offload.config import OffloadConfig
from offload.engine import cpu_step, invariant
from offload.engine.grammars import Grammars
from offload.engine.kv_cache import KVHostPool
from offload.engine.request_maker import RequestMaker
from offload.engine.speculative import Pace, depths_of
from offload.engine.tokens import TokenSteps
from offload.llm.args import tokenizer_of
from offload.llm.fit import MemoryPlan
from offload.model.finite_checks import non_finite_tensor
from offload.model.loader import load_model
from offload.model.tokenizer import eos_token_ids
from offload.offloader.disk_placement import StackRoomError
from offload.planner.overhead import COMPILER_BYTES, fixed_overhead


def load_into(
    llm: Any,
    path: Path,
    empty: torch.nn.Module,
    plan: MemoryPlan,
    tokenizer: str | Path | None,
    dtype: str | torch.dtype,
    load_format: str,
    progress: bool | None,
) -> None:
    """`llm`'s tokenizer (before the weights: its errors come first), then its model with
    its offloader (`empty`, loaded, with the offloader `plan` made, where it is to be
    used), and the state the decode loop keeps between calls."""
    config = plan.config
    llm.tokenizer = tokenizer_of(path, tokenizer, load_format, llm.trust_remote_code)
    llm._tokens = TokenSteps(llm.tokenizer, eos_token_ids(path, llm.tokenizer, empty.config))
    llm._tokens.damage = functools.cache(functools.partial(_damage, path))
    # What cpu_memory_gb does not cover (the figures line of `offload generate` says it).
    llm.fixed_overhead = fixed_overhead(empty, Path(tokenizer) if tokenizer else path)
    if progress is None:  # a bar for the load when someone watches
        progress = sys.stderr.isatty()
    budget = llm.host_budget
    try:
        llm.model, llm.offloader = load_model(
            path,
            config,
            device=llm.device,
            dtype=dtype,
            load_format=load_format,
            progress=progress,
            trust_remote_code=llm.trust_remote_code,
            stack_budget_bytes=budget.stack_bytes if budget is not None else None,
            planned=plan.for_load(),
            # (a pipeline stage's model is the one cut: none is built again from the path)
            model=empty if getattr(empty, "held_layers", None) is not None else None,
        )
    except StackRoomError as error:  # B cannot hold the minimum: said with the numbers
        raise budget.refused(error) from error  # (LLM may fit a shorter context)
    llm._forwards = 0  # model forwards (prefill chunks, decode steps), summed over calls
    llm._compiled_steps = 0  # of which compiled CPU decode steps
    # speculative decoding: verify forwards, rows' guesses, tokens guessed, guesses kept
    llm._spec_verifies = llm._spec_drafts = llm._spec_guessed = llm._spec_kept = 0
    # whether guessing pays, measured by serve's and generate's cores (kept across calls)
    llm._paces = {mode: Pace(depths_of(llm.speculative_config)) for mode in (False, True)}
    # Host memory of the offloaded KV cache, kept between calls (pinned once).
    llm._kv_dims: tuple | None = None  # (the probed dims,), measured on first use
    # (generate's engine core's rows, and serve's: `serving`; one more for each further
    # micro-batch core of a pipeline's serving: `micro_batches`)
    llm._new_kv_pool = functools.partial(
        KVHostPool, llm.device, disable_pin_memory=config.disable_pin_memory
    )
    llm._kv_pool, llm._serving_kv_pool = llm._new_kv_pool(), llm._new_kv_pool()
    llm._more_kv_pools, llm._lane_kv_pools = [], []  # (serve's cores', generate's lanes')


def _damage(path: Path) -> str | None:
    """The checkpoint's tensor holding nan or inf, said in a sentence (None: none does:
    the dtype overflowed)."""
    found = non_finite_tensor(path)
    if found is None:
        return None
    file, name, count = found
    return (
        f"the checkpoint's tensor {name!r} in {file} holds {count} nan or inf values "
        "(the file is damaged: download or convert it again)"
    )


def prepare_steps(llm: Any, config: OffloadConfig, enforce_eager: bool) -> None:
    """Once the model is loaded (its context final): the one check of each request
    (`RequestMaker`), and how `llm`'s decode steps run — CUDA graphs, a compiled CPU
    step, or the eager products batch invariance needs."""
    vocab_size = llm.model.config.vocab_size
    llm._requests = RequestMaker(
        llm.max_model_len,
        vocab_size,
        llm.max_logprobs,
        llm.device,
        llm._tokens.encode,
        Grammars(llm.tokenizer, vocab_size, llm._tokens.eos_ids),  # (compiles on first use)
    )
    # CUDA graphs for decode unless enforce_eager, as vLLM; copies from unpinned memory,
    # per-forward copies or disk reads (queued by a staging thread) cannot be captured.
    uncapturable = config.disable_pin_memory or config.disable_uva or config.disk.is_active
    llm._use_graphs = llm.device.type == "cuda" and not enforce_eager and not uncapturable
    # On a CPU, a compiled decode step where it pays (engine/cpu_step.py), same switch.
    llm._compile_cpu, llm._cpu_step = llm.device.type == "cpu" and not enforce_eager, None
    if llm._pipeline is not None or getattr(llm.model, "held_layers", None) is not None:
        # (a pipeline's steps run eagerly: their sends and receives are not compiled)
        llm._compile_cpu, llm._use_graphs = False, False
    # Batch invariance: products padded as this machine needs, eager steps.
    llm._generator = None  # (`generate`'s engine core, made on first use)
    if llm.batch_invariant:
        multiple = invariant.row_multiple(llm.model, llm.device)
        resident = llm.offloader.offloaded_bytes == 0  # (its weights in place to try)
        invariant.pad_products(llm.model, multiple, probe_stored=resident)
        llm._compile_cpu, llm._use_graphs = False, False
    if llm._compile_cpu and cpu_step.enabled():  # (the compiler stays in the process)
        llm.fixed_overhead = replace(llm.fixed_overhead, compiler_bytes=COMPILER_BYTES)
