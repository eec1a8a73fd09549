"""Attention of a speculative verify forward (`StepRunner.verify`), position by position
as the decode steps it stands for compute it: each row's each query alone, over the
columns a decode step at that query's column reads, through transformers' own SDPA
attention with one query (which packs a grouped query's heads into its length, where
several queries repeat the keys instead: another summation, other bits). With each
position's q8 products computed as a lone row's (`quant.kernels.rows_apart`), a kept
token's logits are then the decode step's, bit for bit, for a model whose other products
round a row alike at any row count (the int4 kernel; not MKL's float32 `F.linear`).

The model attends by this module's registered name for the length of the forward (as
`mixed_step` does), where no compile of the model's step is tracing it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from offload.engine.packed_step import sdpa_like

NAME = "offload_verify"
_current = threading.local()  # .widths: [rows][queries] of the verify forward on this thread
_registered = False


def attention(module, query, key, value, attention_mask, **kwargs):
    """query [rows, heads, queries, dim] over keys and values [rows, kv heads, columns,
    dim] with the 4D boolean mask [rows, 1, queries, columns]: the output [rows, queries,
    heads, dim], as transformers' attention functions return it. The queries of one
    index and width go through one call (each row's bits as alone: the kernel computes
    every row and head apart)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows, heads, queries, dim = query.shape
    widths = torch.tensor(_current.widths, dtype=torch.long)  # [rows, queries]
    decode_mask, gathers, firsts = _current.tree
    if gathers:  # (a tree's node reads its path as its decode step would: at the next columns)
        attention_mask = decode_mask
    # (a mask always, as the decode step passes one: the kernel takes another path without)
    groups: dict[tuple[int, int], list[int]] = {}
    for row, row_widths in enumerate(widths.tolist()):
        for index in range(queries):
            groups.setdefault((index, row_widths[index]), []).append(row)
    out = query.new_empty(rows, queries, heads, dim)
    for (index, width), members in groups.items():
        pick = _rows(members)
        mask = attention_mask[pick, :, index : index + 1, :width]
        keys, values = key[pick, :, :width], value[pick, :, :width]
        moved = [(at, m) for at, m in enumerate(members) if (m, index) in gathers]
        if moved:
            keys, values = keys.clone(), values.clone()
            for at, member in moved:
                first, path = firsts[member], gathers[member, index]
                sources = [first + query_index for query_index in path]
                keys[at, :, first : first + len(path)] = key[member, :, sources]
                values[at, :, first : first + len(path)] = value[member, :, sources]
        part, _ = sdpa_attention_forward(
            module, query[pick, :, index : index + 1], keys, values, mask, **kwargs
        )
        out[pick, index : index + 1] = part  # [members, 1, heads, dim]
    return out, None


def _rows(members: list[int]) -> slice | torch.Tensor:
    """`members` as an index: a slice where they run in a row (no copies)."""
    if members == list(range(members[0], members[-1] + 1)):
        return slice(members[0], members[-1] + 1)
    return torch.tensor(members)


@contextmanager
def verifying(
    model, widths: list[list[int]], jobs: threading.Lock | None, tree=(None, {}, [])
) -> Iterator[bool]:
    """`model` attends position by position inside (True), or as it is (False: one of its
    step's loads or compiles, which holds `jobs`, may be tracing the model). `tree`:
    (the decode steps' mask [rows, 1, queries, width], {(row, query): its path's query
    indices} where a tree's node is not at its depth's column, each row's first column)."""
    global _registered
    config = model.config
    if not sdpa_like(config):
        yield False
        return
    before = config._attn_implementation_internal
    if jobs is not None and not jobs.acquire(blocking=False):
        yield False
        return
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(NAME, attention)
        _registered = True
    try:
        config._attn_implementation_internal = NAME
        _current.widths, _current.tree = widths, tree
        yield True
    finally:
        _current.widths = _current.tree = None
        config._attn_implementation_internal = before
        if jobs is not None:
            jobs.release()
