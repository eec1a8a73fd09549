"""Forwards of packed tokens: a decode step that carries a chunk of one prompt (chunked
prefill mixed with decode, as vLLM schedules it), and the whole prompts admitted in one
turn prefilled together. The running rows' new tokens and the chunks' tokens are packed into
one sequence, so that a turn reads the weights once (an offloaded weight crosses the link
once a turn, not once a prompt) and costs the tokens' compute only.

Every layer but attention treats each token alone, so the packed sequence runs through them
as any forward does (on a CPU with products whose rows round alike at any count: a prompt's
bits are its prefill's alone). Attention is split back (`attention`): the R decode queries,
one per row, over their rows' columns as the row mask says; each chunk's queries over its
row, causal. Both are the SDPA products transformers' attention computes, with the masks it
would have built for each forward alone. The cache layers write each part at its own rows
and columns (`MixedWindow.parts`, from `RowLayer.update`).

For the forward, the model's attention implementation is this module's (a registered name).
A compile on its step jobs' thread traces the same model and reads that name, so the swap
happens only while none of the model's jobs runs (`StepJobs.running`); otherwise the turn
runs its forwards apart, as without packing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import pack_gqa

from offload.engine import prompt_attention
from offload.engine.packed_step import packed_logits, parted, sdpa_like
from offload.engine.prompt_attention import prompt_kernels
from offload.engine.transformers_cache import cache_argument

NAME = "offload_mixed"
_current = threading.local()  # (the window of the mixed forward running on this thread)


@dataclass(slots=True)
class Chunk:
    """A prompt's chunk in a mixed forward: its row `row`, writing at `columns` (a slice)
    and reading as `mask` [1, 1, tokens, chunk width] says (True: read)."""

    row: int
    columns: slice
    mask: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.columns.stop - self.columns.start


@dataclass(slots=True)
class MixedWindow:
    """The parts of a mixed forward: decode rows [0, num_rows) writing at `row_columns`
    [rows, 1] and reading as `row_mask` [rows, 1, 1, width] says (none where `num_rows` is
    0: prompts packed alone), then each of `chunks`, its tokens after the last part's."""

    num_rows: int
    row_columns: torch.Tensor | None
    row_mask: torch.Tensor | None
    chunks: list[Chunk]

    def parts(self, key_states, value_states) -> list[tuple]:
        """The packed tokens' keys and values [1, heads, tokens, dim] as a `RowLayer`
        writes them: (keys, values, columns, first row) of the decode rows, then of each
        chunk."""
        rows = self.num_rows
        parts = []
        if rows:  # ([heads, R, dim] -> [R, heads, 1, dim]: one token for each row)
            decode = [
                s[0, :, :rows].transpose(0, 1).unsqueeze(2) for s in (key_states, value_states)
            ]
            parts.append((*decode, self.row_columns, 0))
        for chunk, (start, end) in zip(self.chunks, self._spans(), strict=True):
            kv = [s[:, :, start:end] for s in (key_states, value_states)]
            parts.append((*kv, chunk.columns, chunk.row))
        return parts

    def _spans(self) -> list[tuple[int, int]]:
        """Each chunk's tokens [start, end) in the packed sequence."""
        spans, start = [], self.num_rows
        for chunk in self.chunks:
            spans.append((start, start + chunk.num_tokens))
            start += chunk.num_tokens
        return spans


def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Attention of a mixed forward (registered as `NAME`): query [1, heads, tokens, dim]
    over the cache's keys and values [rows held, kv heads, columns, dim]; the output
    [1, tokens, heads, dim], as transformers' attention functions return it. Each part is
    the product transformers' SDPA attention computes: the decode rows' called as their
    own decode step calls it (`_decode_sdpa`), each chunk's with its KV heads shared by
    their query heads in the kernel (`enable_gqa`: the same bits as repeating them)."""
    window: MixedWindow = _current.window
    rows, outs = window.num_rows, []
    if rows:
        width = window.row_mask.shape[-1]
        queries = query[0, :, :rows].transpose(0, 1).unsqueeze(2)  # [R, heads, 1, dim]
        kept = key[:rows, :, :width], value[:rows, :, :width]
        decoded = _decode_sdpa(queries, *kept, window.row_mask, scaling)  # [R, heads, 1, dim]
        outs.append(decoded.transpose(0, 2))
    for chunk, (start, end) in zip(window.chunks, window._spans(), strict=True):
        row, chunk_width = chunk.row, chunk.mask.shape[-1]
        kept = key[row : row + 1, :, :chunk_width], value[row : row + 1, :, :chunk_width]
        outs.append(_chunk_sdpa(query[:, :, start:end], *kept, chunk.mask, scaling))
    return torch.cat(outs, dim=2).transpose(1, 2), None


def _decode_sdpa(query, key, value, mask, scale):
    """The decode rows' attention as their own decode step calls it eagerly, so that a
    row's bits are the same beside a chunk as without one: transformers' `pack_gqa`, each
    KV head's query heads as its queries ([R, kv heads, groups, dim]; ATen sums that call
    otherwise than `enable_gqa`'s)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads == kv_heads:
        out = prompt_attention.step_attention(query, key, value, mask, scale=scale)
        return _sdpa(query, key, value, mask, scale) if out is None else out
    packed = pack_gqa(query, heads // kv_heads)  # (transformers' own: the same call)
    out = prompt_attention.step_attention(packed, key, value, mask, scale=scale)
    if out is None:
        out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scale)
    return out.reshape(query.shape[0], heads, 1, value.shape[-1])


def _chunk_sdpa(query, key, value, mask, scale):
    """The chunk's attention as its prefill alone computes it: `prompt_attention` where
    it applies (each position's bits its own), else ATen's."""
    grouped = query.shape[1] != key.shape[1]
    out = prompt_attention.attention(
        query, key, value, mask, scale=scale, enable_gqa=grouped,
        known=prompt_attention.forward_known(),  # (each chunk's mask read once, not a layer)
    )  # fmt: skip
    return _sdpa(query, key, value, mask, scale) if out is None else out


def _sdpa(query, key, value, mask, scale):
    grouped = query.shape[1] != key.shape[1]
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale, enable_gqa=grouped
    )


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(NAME, attention)
        _registered = True


def can_mix(model, cache) -> bool:
    """Whether `model`'s forwards over `cache` (a `rows.RowCache`) can be mixed: SDPA
    attention (the products the parts compute) named by the model's own config (not a
    sub-config's), every layer attending over whole rows (no sliding windows), and rotary
    embeddings that do not depend on the longest position in the batch."""
    config = model.config
    if not sdpa_like(config):
        return False
    if any(getattr(config, key, None) is not None for key in getattr(config, "sub_configs", {})):
        return False  # (its layers may attend by a sub-config's name: not swapped here)
    if cache.masks is not None:
        return False
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    return kind not in ("dynamic", "longrope")


@contextmanager
def mixing(model, window: MixedWindow, jobs: threading.Lock | None) -> Iterator[bool]:
    """`model` attends as a mixed forward inside (True), or not at all (False: one of
    its step's loads or compiles, which holds `jobs`, is running and may be tracing the
    model; the caller runs the parts apart)."""
    if jobs is not None and not jobs.acquire(blocking=False):
        yield False
        return
    _register()
    config = model.config
    before = config._attn_implementation_internal  # (as set: no sub-config to set with it)
    try:
        config._attn_implementation_internal = NAME
        _current.window = window
        yield True
    finally:
        _current.window = None
        config._attn_implementation_internal = before
        if jobs is not None:
            jobs.release()


def packed_forward(runner, rows: list, chunks: list[tuple]):
    """One forward of `runner`'s (a `StepRunner`) decode step of `rows` and of `chunks`
    (group, start, end), columns [start, end) of each group's prompt, packed into one
    sequence: the rows' logits [rows, vocab] and each chunk's as a prefill returns them;
    None where they cannot share a forward now (`mixing`). Compiled where it can be
    (`packed_step`), else eager."""
    if rows and runner.packed_steps:
        out = packed_logits(runner, rows, chunks)
        if out is not None:
            return out
    device, model = runner.model.device, runner.model.model
    ids: list[int] = [row.input_token for row in rows]
    positions, parts, keep, high = [], [], list(range(len(rows))), 0
    row_columns = row_mask = None
    if rows:
        at = [min(row.column, runner.max_len - 1) for row in rows]
        width = runner.reading_width(max(at) + 1)
        starts = [row.start for row in rows]
        row_columns, row_starts, row_mask = rows_reading(at, starts, width, device)
        positions.append((row_columns - row_starts)[:, 0])
        row_mask, high = row_mask[:, None, None, :], max(at) + 1
    for group, start, end in chunks:
        chunk_ids, columns, chunk_positions = runner.chunk_of(group, start, end)
        # (each chunk position reads its own columns: the bits of its prefill alone)
        every = torch.arange(end, device=device)
        mask = (every >= group.rows[0].start) & (every <= columns[:, None])
        parts.append(Chunk(group.first, slice(start, end), mask[None, None, :, :]))
        first = len(ids)
        ids += chunk_ids
        positions.append(chunk_positions)
        keep += range(first, len(ids) - 1) if group.every_position else ()
        keep.append(len(ids) - 1)
        high = max(high, end)
    window = MixedWindow(len(rows), row_columns, row_mask, parts)
    compiled = runner.model.compiled
    # (prompts alone: the products their prefill takes; beside rows: the step's)
    kernels = runner.kernels() if rows else prompt_kernels(model, device)
    with mixing(model, window, None if compiled is None else compiled.running) as mixes:
        if not mixes:
            return None
        runner.cache.forward_writes(high)
        runner.cache.window.mixed = window
        try:
            with kernels, prompt_attention.one_forward() as forward:  # (`attention`)
                out = model(
                    input_ids=torch.tensor([ids], device=device),
                    position_ids=torch.cat(positions)[None, :],
                    **cache_argument(model, runner.cache.cache),
                    cache_position=torch.arange(len(ids), device=device),
                    use_cache=True,
                    logits_to_keep=torch.tensor(keep, device=device),
                )
        finally:
            runner.cache.window.mixed = None
    runner.model.on_forward(False)
    return parted(runner, rows, chunks, out.logits[0], forward.exact)  # ([rows + kept, vocab])


def rows_reading(at: list[int], starts: list[int], width: int, device):
    """Decode rows at columns `at` whose prompts begin at `starts`: their columns and
    starts [rows, 1], and which of the first `width` columns each reads [rows, width]
    (from its start up to its own column)."""
    columns = torch.tensor(at, device=device)[:, None]
    start = torch.tensor(starts, device=device)[:, None]
    every = torch.arange(width, device=device)
    return columns, start, (every >= start) & (every <= columns)
