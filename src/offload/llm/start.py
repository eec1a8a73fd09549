"""What `LLM(...)` does once its arguments are checked (`EngineArgs`) and its model
resolved (`ModelSpec`): plan the memory, load the weights within the budgets, and
prepare the decode steps."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from offload.llm.args import as_run, check_attention_model
from offload.llm.auto import planned_memory
from offload.llm.budget import host_budget_of, load_fitted
from offload.llm.drafting import load_drafter
from offload.llm.engine_args import EngineArgs
from offload.llm.loading import load_into, prepare_steps
from offload.llm.pipelined import failed, join_stage, start_stage
from offload.model.spec import ModelSpec


def start_llm(llm: Any, args: EngineArgs, spec: ModelSpec) -> None:
    """Plan, load and prepare `llm` (its limits set from `args` already) for `spec`; with
    `pipeline_parallel_size` > 1, its stage of the model (`pipelined`)."""
    check_attention_model(spec.empty)
    llm._pipeline, member, empty = None, None, spec.empty
    if args.pipeline_parallel_size > 1:
        member, empty = join_stage(args, empty, spec.path, spec.device)
    try:
        with warnings.catch_warnings():
            if member is not None:  # (an amount set for the whole stack: a stage's all)
                warnings.filterwarnings("ignore", "cpu_offload_gb .* offloadable parameters")
            _start(llm, args, spec, empty)
    except BaseException as error:
        if member is not None:
            failed(member, error)
        raise
    if member is not None:
        start_stage(llm, member)  # (on a rank but 0: serves its stage, then exits)
    llm._drafter = load_drafter(llm, args.speculative)  # (speculative decoding's draft)
    torch.manual_seed(args.seed)


def _start(llm: Any, args: EngineArgs, spec: ModelSpec, empty) -> None:
    path, config = spec.path, args.config
    plan = planned_memory(
        llm,
        path,
        empty,
        config,
        args.max_model_len,
        args.gpu_memory_utilization,
        args.device_memory_gb,
    )
    asked_gb = config.disk.cpu_memory_gb  # (a plan may keep fewer layers in RAM)
    llm.max_model_len, llm.memory_needs, config = plan.max_model_len, plan.needs, plan.config
    llm.offload_config = as_run(config)  # what runs: "auto" resolved, the planner's choice
    # On a CPU, cpu_memory_gb bounds the process (llm/budget.py), planned or not.
    budget_gb = asked_gb if config.disk.is_active else None
    offloaded, device_memory_gb = plan.offloaded_bytes, args.device_memory_gb
    llm.host_budget = host_budget_of(llm, empty, offloaded, budget_gb, device_memory_gb)
    load = functools.partial(
        load_into,
        llm,
        path,
        empty,
        plan,
        args.tokenizer,
        spec.dtype,
        args.load_format,
        args.progress,
    )
    fit = args.max_model_len is None  # (the default context may shrink to fit the budget)
    load_fitted(llm, load, empty, offloaded, (budget_gb, device_memory_gb), fit)
    prepare_steps(llm, config, args.enforce_eager)
    llm.seed = args.seed
