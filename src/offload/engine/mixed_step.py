"""A decode step that carries a chunk of one prompt (chunked prefill mixed with decode, as
vLLM schedules it): the running rows' new tokens and the chunk's tokens packed into one
sequence of R + C tokens, so that a turn reads the weights once (an offloaded weight
crosses the link once a turn, not twice) and costs the chunk's compute only.

Every layer but attention treats each token alone, so the packed sequence runs through them
as any forward does. Attention is split back (`attention`): the R decode queries, one per
row, over their rows' columns as the row mask says; the chunk's queries over its row,
causal. Both are the SDPA products transformers' attention computes, with the masks it
would have built for each forward alone. The cache layers write each part at its own rows and columns
(`MixedWindow.parts`, from `RowLayer.update`).

For the forward, the model's attention implementation is this module's (a registered name).
A compile on its step jobs' thread traces the same model and reads that name, so the swap
happens only while none of the model's jobs runs (`StepJobs.running`); otherwise the turn
runs its two forwards apart, as without mixing.
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

NAME = "offload_mixed"
_current = threading.local()  # (the window of the mixed forward running on this thread)


@dataclass(slots=True)
class MixedWindow:
    """The two parts of a mixed forward: decode rows [0, num_rows) writing at
    `row_columns` [rows, 1] and reading as `row_mask` [rows, 1, 1, width] says; the
    chunk's row `chunk_row` writing at `chunk_columns` (a slice) and reading as
    `chunk_mask` [1, 1, tokens, chunk width] says (True: read)."""

    num_rows: int
    row_columns: torch.Tensor
    row_mask: torch.Tensor
    chunk_row: int
    chunk_columns: slice
    chunk_mask: torch.Tensor

    def parts(self, key_states, value_states) -> list[tuple]:
        """The packed tokens' keys and values [1, heads, R + C, dim] as a `RowLayer`
        writes them: (keys, values, columns, first row) of the decode rows, then the
        chunk's."""
        rows = self.num_rows
        # ([heads, R, dim] -> [R, heads, 1, dim]: one token for each row)
        decode = [s[0, :, :rows].transpose(0, 1).unsqueeze(2) for s in (key_states, value_states)]
        chunk = [s[:, :, rows:] for s in (key_states, value_states)]
        return [(*decode, self.row_columns, 0), (*chunk, self.chunk_columns, self.chunk_row)]


def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Attention of a mixed forward (registered as `NAME`): query [1, heads, R + C, dim]
    over the cache's keys and values [rows held, kv heads, columns, dim]; the output
    [1, R + C, heads, dim], as transformers' attention functions return it. Each part is
    the product transformers' SDPA attention computes: the decode rows' called as their
    own decode step calls it (`_decode_sdpa`), the chunk's with its KV heads shared by
    their query heads in the kernel (`enable_gqa`: the same bits as repeating them)."""
    window: MixedWindow = _current.window
    rows, width = window.num_rows, window.row_mask.shape[-1]
    queries = query[0, :, :rows].transpose(0, 1).unsqueeze(2)  # [R, heads, 1, dim]
    kept = key[:rows, :, :width], value[:rows, :, :width]
    decoded = _decode_sdpa(queries, *kept, window.row_mask, scaling)  # [R, heads, 1, dim]
    row, chunk_width = window.chunk_row, window.chunk_mask.shape[-1]
    kept = key[row : row + 1, :, :chunk_width], value[row : row + 1, :, :chunk_width]
    chunk = _chunk_sdpa(query[:, :, rows:], *kept, window.chunk_mask, scaling)  # [1, heads, C, dim]
    return torch.cat([decoded.transpose(0, 2), chunk], dim=2).transpose(1, 2), None


def _decode_sdpa(query, key, value, mask, scale):
    """The decode rows' attention as their own decode step calls it eagerly, so that a
    row's bits are the same beside a chunk as without one: transformers' `pack_gqa`, each
    KV head's query heads as its queries ([R, kv heads, groups, dim]; ATen sums that call
    otherwise than `enable_gqa`'s)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads == kv_heads:
        return _sdpa(query, key, value, mask, scale)
    packed = pack_gqa(query, heads // kv_heads)  # (transformers' own: the same call)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scale)
    return out.reshape(query.shape[0], heads, 1, value.shape[-1])


def _chunk_sdpa(query, key, value, mask, scale):
    """The chunk's attention as its prefill alone computes it: `prompt_attention` where
    it applies (each position's bits its own), else ATen's."""
    grouped = query.shape[1] != key.shape[1]
    out = prompt_attention.attention(query, key, value, mask, scale=scale, enable_gqa=grouped)
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
    if getattr(config, "_attn_implementation_internal", None) != "sdpa":
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
