"""Pipeline parallel for an `LLM` (`pipeline_parallel_size`, vLLM's name): each rank a
process holding a contiguous stage of the decoder layers with its own offloading and
budget (`distributed/`). Rank 0 is the `LLM` the caller holds: it schedules, samples and
answers; the others load their stage and repeat its calls (`distributed.worker`), inside
`LLM(...)`, which on those ranks returns only when rank 0 closes (by ending the process:
a launcher's script then runs no further)."""

from __future__ import annotations

import sys
from dataclasses import fields
from typing import Any

from torch import nn

from offload.distributed.cut import Link, cut_to_stage
from offload.distributed.join import Member, join, leave, place_of
from offload.distributed.messages import Open
from offload.distributed.pipeline import Pipeline
from offload.distributed.worker import StageWorker, refuse
from offload.engine.step_runner import StepRunner
from offload.llm.engine_args import EngineArgs
from offload.model.spec import ModelSpec
from offload.probes.limits import rank_rates

RANK_MODULE = "offload.llm.pipeline_rank"  # what a rank started here runs


def join_stage(args: EngineArgs, empty: nn.Module, path, device) -> tuple[Member, nn.Module]:
    """This process in `args`' pipeline (the other ranks started here where no launcher
    did), and `empty` cut to its stage; the split weighs each rank's budget and its
    rates measured now (`rank_rates`: its RAM, and its disk where it has a budget)."""
    disk = args.config.disk  # (this rank's budget: under torchrun, each its own flags)
    gib = disk.cpu_memory_gb
    room = int(gib * 2**30) if disk.is_active and gib is not None else None
    size, kwargs, place = args.pipeline_parallel_size, rank_kwargs(args), place_of(device)
    member = join(size, empty, kwargs, RANK_MODULE, room, place, rank_rates(path, room))
    return member, cut_to_stage(empty, member.stage)


def rank_kwargs(args: EngineArgs) -> dict[str, Any]:
    """The `LLM` arguments a rank started here is made with: rank 0's (a spec by what it
    names), without a progress bar."""
    kwargs = {f.name: getattr(args, f.name) for f in fields(args) if f.init}
    kwargs.update(kwargs.pop("offload_flags"))
    spec = kwargs["model"]
    if isinstance(spec, ModelSpec):
        kwargs.update(
            model=str(spec.path), device=str(spec.device), dtype=spec.dtype,
            quantization=spec.quantization,
        )  # fmt: skip
    kwargs["progress"] = False
    return kwargs


def failed(member: Member, error: BaseException) -> None:
    """This rank could not load its stage: rank 0 told (another rank) or the others
    ended (rank 0)."""
    if member.stage.is_first:
        leave(member, wait_s=1.0)
    else:
        refuse(member, error)
        leave(member, wait_s=0.0)


def start_stage(llm: Any, member: Member) -> None:
    """Once `llm`'s stage is loaded: on rank 0 the pipeline its cores run over (every
    other rank's stage loaded first); on the others, their loop until rank 0 closes, then
    the process ends."""
    link = Link(member.channel, member.stage)
    link.attach(llm.model)
    if member.stage.is_first:
        pipeline = Pipeline(member, link, (llm._kv_pool, llm._serving_kv_pool))
        try:
            pipeline.wait_ready()
        except BaseException:
            pipeline.close()
            raise
        llm._pipeline = pipeline
        return
    worker = StageWorker(member, link, lambda message: _runner(llm, message))
    try:
        worker.run()
    finally:
        llm.close()
        leave(member, wait_s=0.0)
    sys.exit(0)


def _runner(llm: Any, message: Open) -> StepRunner:
    """The step runner rank 0's `Open` asks for, over this rank's stage."""
    from offload.llm.cores import engine_model  # (cores imports this module)

    dims = tuple(message.kv_dims) if message.kv_dims is not None else None
    return StepRunner(
        engine_model(llm, generate=True, compiles=False),  # (one thread: no lock taken)
        message.max_rows,
        message.max_len,
        dims,
        message.invariant,
        None if message.pool is None else kv_pool(llm, message.pool),
    )


def kv_pool(llm: Any, number: int):
    """The KV offload pool rank 0's runner calls `number` (`Pipeline.pool_number`): one
    each of this rank's, made on first use past `generate`'s and the serving core's."""
    if number < 2:
        return (llm._kv_pool, llm._serving_kv_pool)[number]
    more = llm._more_kv_pools
    while len(more) <= number - 2:
        more.append(llm._new_kv_pool())
    return more[number - 2]
