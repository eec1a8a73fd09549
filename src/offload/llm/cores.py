"""The engine cores an `LLM` runs: `offload serve`'s and `stream`'s on a thread of their
own (`LLM.serving`), and `generate`'s on the caller's (`generating.Generating`). Both are
`EngineCore`s over the same model, steps and counters."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from offload.engine import cpu_linear, cpu_step
from offload.engine.compiled_step import CompiledCpuStep
from offload.engine.core import EngineCore
from offload.engine.requests import EngineModel
from offload.engine.row_graphs import CudaGraphMaker, RowGraphs
from offload.engine.rows import MIN_ROWS, bytes_per_row, page_columns
from offload.engine.transfer_stats import TransferStats
from offload.engine.transformers_cache import probe_kv_dims
from offload.errors import ConfigError, ModelError
from offload.llm.drafting import speculator_of
from offload.llm.generating import Generating
from offload.llm.serving import kv_cache_room, takes_as_written
from offload.memory.kv_shape import check_host_kv, kv_shape_of
from offload.offloader.hooks import attach_boundaries
from offload.offloader.layers import find_layers
from offload.sizes import compute_dtype

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
) -> EngineCore:
    """A core of `rows` rows of `length` positions over `llm`'s model. `generate`: run by
    a caller that holds the model's lock already, each answer kept in one form, eager or
    compiled (`StepRunner.keep_form`), its KV in host memory from `generate`'s pool.
    `compiles`: its decode steps compiled where that pays (else eager). `room`: the
    positions its rows hold together (`takes_as_written`; None: each row its length).
    `kv_pool`: where its rows' offloaded KV cache lives (else generate's or serve's)."""
    model = engine_model(llm, generate, compiles)
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
    core.runner.keep_form = generate
    return core


def engine_model(llm: Any, generate: bool, compiles: bool) -> EngineModel:
    """What an engine core (or a pipeline rank's step runner) runs: `llm`'s model, its
    token steps and counters; its compiled CPU step where `compiles` and it pays."""
    compiles = compiles and not llm.batch_invariant
    return EngineModel(
        llm.model,
        llm._tokens,
        llm.device,
        llm.tokenizer.pad_token_id or 0,
        contextlib.nullcontext() if generate else llm._lock,
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

    return Generating(
        llm._requests,
        lambda rows, length, rounded, room: engine_core(
            llm, rows, length, own_thread=False, generate=True, compiles=rounded, room=room
        ),
        lambda: kv_cache_room(llm),
        bytes_per_row(config, 1, dtype, dims),
        llm.max_num_seqs,
        too_big,
        page_columns(config, dtype, dims) if takes_as_written(llm) else None,
    )
