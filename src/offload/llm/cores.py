"""The engine cores an `LLM` runs: `offload serve`'s and `stream`'s on a thread of their
own (`LLM.serving`), and `generate`'s on the caller's (`generating.Generating`). Both are
`EngineCore`s over the same model, steps and counters; over a pipeline, several of them
as micro-batches in flight (`engine.micro_batches`)."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Any

import torch

from offload.engine import cpu_linear, cpu_step
from offload.engine.core import EngineCore
from offload.engine.micro_batches import MicroBatches
from offload.engine.requests import EngineModel
from offload.engine.row_graphs import CudaGraphMaker, RowGraphs
from offload.engine.rows import MIN_ROWS, bytes_per_row, page_columns
from offload.engine.transfer_stats import TransferStats
from offload.engine.transformers_cache import probe_kv_dims
from offload.errors import ConfigError, ModelError
from offload.llm.drafting import speculator_of
from offload.llm.generating import Generating
from offload.llm.serving import kv_cache_room, row_plan, takes_as_written
from offload.memory.kv_shape import check_host_kv, kv_shape_of
from offload.offloader.hooks import attach_boundaries
from offload.offloader.layers import find_layers
from offload.sizes import compute_dtype

if TYPE_CHECKING:
    from offload.engine.compiled_step import CompiledCpuStep

_logger = logging.getLogger("offload")


def engine_core(
    llm: Any,
    rows: int,
    length: int,
    *,
    own_thread: bool,
    generate: bool,
    compiles: bool = True,
    room: int | None = None,
    kv_pool=None,
    lock=None,
) -> EngineCore:
    """A core of `rows` rows of `length` positions over `llm`'s model. `generate`: run by
    a caller that holds the model's lock already, each answer kept in one form, eager or
    compiled (`StepRunner.keep_form`), its KV in host memory from `generate`'s pool.
    `compiles`: its decode steps compiled where that pays (else eager). `room`: the
    positions its rows hold together (`takes_as_written`; None: each row its length).
    `kv_pool`: where its rows' offloaded KV cache lives (else generate's or serve's);
    `lock`: what its forwards hold (else the LLM's, or none for `generate`'s)."""
    model = engine_model(llm, generate, compiles, lock)
    pool = kv_pool or (llm._kv_pool if generate else llm._serving_kv_pool)
    graphs = None
    if llm._use_graphs:  # (CUDA graphs of the decode steps, each shape's on first use)
        maker, offloader = CudaGraphMaker(llm.offloader), llm.offloader

        def graphs(held_rows: int) -> RowGraphs:
            return RowGraphs(maker, held_rows, lambda: TransferStats.of(offloader.stats()))

    def make(rows: int, room: int | None) -> EngineCore:
        return EngineCore(
            model,
            rows,
            length,
            llm.max_num_batched_tokens,
            kv_dims=probed_kv_dims(llm) if llm.kv_offload else None,
            own_thread=own_thread,
            invariant=llm.batch_invariant,
            host_pool=pool if llm.kv_offload else None,
            graphs=graphs,
            prefix_caching=llm.prefix_caching,
            room=room,
            speculator=speculator_of(llm, rows, length),
            pace=llm._paces[generate],
        )

    # Rows take address space for their whole length (on a CPU, memory only as they
    # write), which a strict overcommit policy or an address-space limit may refuse:
    # then half as many rows, sharing the same room.
    while True:
        try:
            core = make(rows, room)
            break
        except RuntimeError as error:
            if "allocate" not in str(error):
                raise
            if rows == 1:
                raise ConfigError(
                    f"the KV cache's rows of {length} positions could not be allocated "
                    f"({str(error).splitlines()[0]}); lower max_model_len"
                ) from None
            _logger.warning(
                "the address space for %d rows of %d positions of KV cache was refused; "
                "trying %d", rows, length, rows // 2,
            )  # fmt: skip
            rows //= 2
    # (on a CPU with the row-invariant products the compiled step gives the eager step's
    # bits, `engine/step_order`: an answer may switch to it midway)
    same_bits = torch.device(llm.device).type == "cpu" and cpu_linear.row_invariant(llm.model)
    core.runner.keep_form = generate and not same_bits
    return core


def engine_model(llm: Any, generate: bool, compiles: bool, lock=None) -> EngineModel:
    """What an engine core (or a pipeline rank's step runner) runs: `llm`'s model, its
    token steps and counters; its compiled CPU step where `compiles` and it pays."""
    compiles = compiles and not llm.batch_invariant
    return EngineModel(
        llm.model,
        llm._tokens,
        llm.device,
        llm.tokenizer.pad_token_id or 0,
        lock or (contextlib.nullcontext() if generate else llm._lock),
        on_forward=llm._count_forward,
        on_verified=llm._count_verified,
        # (one graph for every batch of 2 to 64 rows, one for a lone row: `rows.RowStep`)
        compiled=compiled_step(llm) if compiles else None,
        weights_in_place=llm.offloader.weights_in_place,
        pipeline=llm._pipeline,
    )


def compiled_step(llm: Any) -> CompiledCpuStep | None:
    """`llm`'s compiled CPU decode step where it pays (`cpu_step.pays`; not with
    enforce_eager), made on first use. Weights kept as stored keep their own products, the
    rest of the step fuses: the default model as stored, whose server steps of 2-32 rows
    run faster compiled than eager (docs/benchmarks.md, "2026-11-28 (twenty-first
    session): the server's few-row steps, and the default model's steps as stored (issue
    28)")."""
    if not llm._compile_cpu or not cpu_step.enabled() or not cpu_step.pays(llm.model):
        return None
    if cpu_linear.MAX_ROWS < MIN_ROWS:  # (its batches' graph writes no product)
        return None
    if llm._cpu_step is None:
        # (imported here: importing the package imports no dynamo, `compile_options`)
        from offload.engine.compiled_step import CompiledCpuStep

        llm._cpu_step = CompiledCpuStep()
        with contextlib.suppress(ModelError):  # (no layer stack: nothing offloads either)
            attach_boundaries(find_layers(llm.model))
    return llm._cpu_step


def probed_kv_dims(llm: Any):
    """What `llm`'s attention layers really cache (heads, key and value dims), measured
    by a forward on first use."""
    if llm._kv_dims is None:
        llm._kv_dims = (probe_kv_dims(llm.model),)
        llm._forwards += 1  # the probe is a forward of the whole model too
    return llm._kv_dims[0]


def generator_of(llm: Any) -> Generating:
    """`generate`'s core maker, sized per call within the KV room (`kv_cache_room`)."""
    config, dtype = llm.model.config, compute_dtype(llm.model)
    dims = probed_kv_dims(llm) if llm.kv_offload else None

    def too_big(rows: int, length: int) -> None:
        if llm.kv_offload:  # (said as a host cache too large for swap_space)
            shape = kv_shape_of(config, rows, length, dtype, dims)
            held = llm._kv_pool.num_bytes
            check_host_kv(shape, config.num_hidden_layers, llm.swap_space_bytes, held)

    def make(rows: int, length: int, rounded: bool, room: int | None, lanes: int):
        if lanes == 1:
            return engine_core(
                llm, rows, length, own_thread=False, generate=True, compiles=rounded, room=room
            )
        lock = threading.Lock()  # (the lanes' forwards and sampling one at a time)
        pools = llm._lane_kv_pools  # (lane i > 0's host KV pool, kept across calls)
        while len(pools) < lanes - 1:
            pools.append(llm._new_kv_pool())
        share = None if room is None else room // lanes
        cores = []
        for lane in range(lanes):
            pool = pools[lane - 1] if lane and llm.kv_offload else None
            core = engine_core(
                llm, rows, length, own_thread=False, generate=True, compiles=rounded,
                room=share, kv_pool=pool, lock=lock,
            )  # fmt: skip
            cores.append(core)
        return MicroBatches(cores, own_thread=False)

    return Generating(
        llm._requests,
        make,
        lambda: kv_cache_room(llm),
        bytes_per_row(config, 1, dtype, dims),
        llm.max_num_seqs,
        too_big,
        page_columns(config, dtype, dims) if takes_as_written(llm) else None,
        micro_batch_count(llm),
    )


def micro_batch_count(llm: Any) -> int:
    """How many engine cores `llm`'s serving runs over a pipeline: `pipeline_micro_batches`,
    else one per rank (vLLM's) where each rank computes on its own host or GPU, so each
    has a micro-batch to work on; one where ranks share one (each micro-batch reads the
    weights again, and ranks on the same cores only take turns: measured slower,
    docs/benchmarks.md); one without a pipeline."""
    pipeline = llm._pipeline
    if pipeline is None:
        return 1
    if llm.pipeline_micro_batches is not None:
        return llm.pipeline_micro_batches
    return pipeline.size if pipeline.member.apart else 1


def serving_engine(llm: Any, rows: int, fixed_length: bool, own_thread: bool):
    """`llm`'s serving engine (an `EngineCore`, or `MicroBatches` over a pipeline), each
    core's `rows` rows sharing the KV room (`row_plan`), and the positions a request may
    hold."""
    count = micro_batch_count(llm)
    plan = row_plan(llm, rows, fixed_length, share=count)

    def core(index: int, threaded: bool) -> EngineCore:
        pool = None
        if index > 0 and llm.kv_offload:  # (each core's rows a host KV pool of their own)
            pool = llm._new_kv_pool()
            llm._more_kv_pools.append(pool)
        return engine_core(
            llm, plan.rows, plan.length, own_thread=threaded, generate=False,
            room=plan.room, kv_pool=pool,
        )  # fmt: skip

    if count == 1:
        return core(0, own_thread), plan.length
    return MicroBatches([core(i, False) for i in range(count)], own_thread), plan.length
