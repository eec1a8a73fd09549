"""The engine cores an `LLM` runs: `offload serve`'s and `stream`'s on a thread of their
own (`LLM.serving`), and `generate`'s on the caller's (`generating.Generating`). Both are
`EngineCore`s over the same model, steps and counters."""

from __future__ import annotations

import contextlib
from typing import Any

from offload.engine.core import EngineCore
from offload.engine.requests import EngineModel
from offload.engine.rows import MIN_ROWS, bytes_per_row
from offload.llm.generating import Generating
from offload.llm.serving import kv_cache_room
from offload.memory.kv_shape import check_host_kv, kv_shape_of
from offload.sizes import compute_dtype


def engine_core(
    llm: Any, rows: int, length: int, *, own_thread: bool, generate: bool, compiles: bool = True
) -> EngineCore:
    """A core of `rows` rows of `length` positions over `llm`'s model. `generate`: run by
    a caller that holds the model's lock already, each answer kept in one form, eager or
    compiled (`StepRunner.keep_form`), its KV in host memory from `generate`'s pool.
    `compiles`: its decode steps compiled where that pays (else eager)."""
    compiles = compiles and not llm.batch_invariant
    model = EngineModel(
        llm.model,
        llm._tokens,
        llm.device,
        llm.tokenizer.pad_token_id or 0,
        contextlib.nullcontext() if generate else llm._lock,
        on_forward=llm._count_forward,
        # (one graph for every batch of 2 to 64 rows: `rows.RowStep`)
        compiled=llm._compiled_step(MIN_ROWS) if compiles else None,
        weights_in_place=llm.offloader.weights_in_place,
    )
    pool = llm._kv_pool if generate else llm._serving_kv_pool
    core = EngineCore(
        model,
        rows,
        length,
        llm.max_num_batched_tokens,
        kv_dims=llm._probed_kv_dims() if llm.kv_offload else None,
        own_thread=own_thread,
        invariant=llm.batch_invariant,
        host_pool=pool if llm.kv_offload else None,
    )
    core.runner.keep_form = generate
    return core


def generator_of(llm: Any) -> Generating:
    """`generate`'s core maker, sized per call within the KV room (`kv_cache_room`)."""
    config, dtype = llm.model.config, compute_dtype(llm.model)
    dims = llm._probed_kv_dims() if llm.kv_offload else None

    def too_big(rows: int, length: int) -> None:
        if llm.kv_offload:  # (said as a host cache too large for swap_space)
            shape = kv_shape_of(config, rows, length, dtype, dims)
            held = llm._kv_pool.num_bytes
            check_host_kv(shape, config.num_hidden_layers, llm.swap_space_bytes, held)

    return Generating(
        llm._requests,
        lambda rows, length, rounded: engine_core(
            llm, rows, length, own_thread=False, generate=True, compiles=rounded
        ),
        lambda: kv_cache_room(llm),
        bytes_per_row(config, 1, dtype, dims),
        llm.max_num_seqs,
        too_big,
    )
