"""A forward of tokens packed into one sequence, each token over its own row and columns
of the `rows.RowCache`, compiled as one graph of dynamic length: a decode step with
prompts riding in it (chunked prefill mixed with decode, `mixed_step`) as the compiled
step, not eagerly.

A decode step is the case of one token a row. Here the running rows' new tokens and the
prompts' tokens are one sequence [1, tokens]; every layer but attention treats each token
alone (the row-invariant products on a CPU: a token's bits are its own at any count),
the cache layers write token t at (`rows[t]`, `columns[t]`) (`RowLayer.update`, one op
compiled), and attention (`ROW_ATTENTION`, one opaque op) runs `rowdot_attention` once a
layer with each token over columns [lo, hi) of its own row: the kernel computes each
query alone in one fixed order, so a token has the bits of its decode step or its prefill
alone (`prompt_attention`), and the eager mixed forward's (`test_packed_step`).

The model's attention implementation is `NAME`, set once when the runner is made (not
swapped around a forward: a compile on the step jobs' thread traces the model while the
decode loop's forwards run). Without the packed step's keywords it is transformers' SDPA
attention with SDPA's masks, so every other forward computes what it did.
"""

from __future__ import annotations

import logging

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from offload.engine import cpu_linear, prompt_attention
from offload.engine.transformers_cache import cache_argument
from offload.offloader.ops import define_op
from offload.quant import row_dot

log = logging.getLogger(__name__)

NAME = "offload_packed"
_NO_MASK = torch.zeros((1, 1, 1, 1), dtype=torch.bool)  # (4D: transformers builds no mask)


class NotPassedOn(RuntimeError):
    """A packed step's attention was called without its keywords (`packed_logits` then
    turns packed steps off: the eager mixed forward runs)."""


def sdpa_like(config) -> bool:
    """Whether `config`'s attention is SDPA's: transformers' name, or `NAME` (the same
    forwards but the packed step's)."""
    return getattr(config, "_attn_implementation_internal", None) in ("sdpa", NAME)


def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """The attention of `NAME`: a packed step's (`offload_rows`: each token's row [tokens],
    `offload_bounds`: its columns [2, tokens], lo and hi) through `ROW_ATTENTION`, over
    the cache's rows as they lie; else transformers' SDPA attention."""
    rows, bounds = kwargs.pop("offload_rows", None), kwargs.pop("offload_bounds", None)
    if rows is None:
        if key.shape[0] != query.shape[0]:  # (the cache's every row: a packed step's)
            raise NotPassedOn("the model's layers do not pass its keywords to attention")
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, **kwargs
        )
    out = ROW_ATTENTION(query, key, value, bounds, rows, scaling)  # [tokens, heads, dim]
    return out[None], None  # [1, tokens, heads, dim], as transformers' functions return it


def _row_attention(query, key, value, bounds, rows, scale):
    """query [1, heads, tokens, dim]; key and value [rows held, kv heads, columns, dim] (the
    cache's); bounds [2, tokens]; rows [tokens]: each token's heads over columns [lo, hi)
    of its row, by `rowdot_attention`: a run of tokens of one row (a prompt's chunk) as
    one sequence, which reads each tile of its keys once for all of them; the tokens of
    rows of their own (the decode rows) as a batch of sequences of one query. The kernel
    computes each query alone, so how they are grouped moves no bit."""
    _, heads, tokens, dim = query.shape
    q = query[0].transpose(0, 1).to(torch.float32).contiguous()  # [tokens, heads, dim]
    out = torch.empty(tokens, heads, dim)
    lo, hi = (b.contiguous() for b in bounds)
    rows = rows.contiguous()
    scale = dim**-0.5 if scale is None else scale
    for start, end, run in _runs(rows.tolist()):
        at = (key, value, lo[start:], hi[start:], rows[start:], scale)
        if run:  # (one sequence of end - start queries: [1, heads, tokens, dim])
            part = q[start:end].transpose(0, 1).contiguous()
            done = torch.empty_like(part)
            _kernel(part, done, 1, end - start, heads, *at)
            out[start:end] = done.transpose(0, 1)
        else:  # (sequences of one query each, their rows' own: [tokens, heads, 1, dim])
            _kernel(q[start:end], out[start:end], end - start, 1, heads, *at)
    prompt_attention.record_call(exact=True)
    return out.to(query.dtype)


def _runs(rows: list[int]) -> list[tuple[int, int, bool]]:
    """The tokens [start, end) in order: each run of two or more tokens of one row (True),
    and between them the tokens of rows of their own (False)."""
    runs, start = [], 0
    while start < len(rows):
        end = start + 1
        while end < len(rows) and rows[end] == rows[start]:
            end += 1
        if end - start > 1:
            runs.append((start, end, True))
        elif runs and not runs[-1][2] and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], end, False)
        else:
            runs.append((start, end, False))
        start = end
    return runs


def _kernel(q, out, sequences: int, tokens: int, heads: int, key, value, lo, hi, rows, scale):
    """`rowdot_attention` of `q` [sequences, heads, tokens, dim] (contiguous) into `out`
    (likewise): sequence i over row `rows[i]` of `key` and `value`, its tokens' columns
    [lo, hi) from `lo` and `hi` ([sequences * tokens], from the first)."""
    dim = q.shape[-1]
    failed = row_dot.library().rowdot_attention(
        q.data_ptr(), sequences, heads, tokens, dim, key.data_ptr(), value.data_ptr(),
        prompt_attention.TYPES[value.dtype], *key.stride()[:3], *value.stride()[:3],
        heads // key.shape[1], lo.data_ptr(), hi.data_ptr(), 1, scale, out.data_ptr(),
        torch.get_num_threads(), rows.data_ptr(),
    )  # fmt: skip
    if failed:
        raise MemoryError(f"no memory for the attention scores of {tokens} tokens")


def _row_attention_fake(query, key, value, bounds, rows, scale):
    _, heads, tokens, _ = query.shape
    return query.new_empty((tokens, heads, value.shape[-1]))


ROW_ATTENTION = define_op(
    "row_attention",
    "(Tensor query, Tensor key, Tensor value, Tensor bounds, Tensor rows, float? scale) -> Tensor",
    _row_attention,
    _row_attention_fake,
)

_registered = False


def use(model) -> None:
    """`model` attends through `NAME` (where its attention is SDPA's)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(NAME, attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)  # (SDPA's masks for the rest)
        _registered = True
    if model.config._attn_implementation_internal == "sdpa":
        model.config._attn_implementation_internal = NAME


def takes(model, cache) -> bool:
    """Whether `model`'s forwards over `cache` (a `rows.RowCache`) can run packed: on a
    CPU with the attention kernel built, a cache of a dtype it reads and heads it takes,
    in device memory (not KV offload's slots)."""
    if row_dot.library() is None or cache.kv_offloader is not None:
        return False
    layer = cache.cache.layers[cache.held_layers[0]] if cache.held_layers else None
    keys = getattr(layer, "all_keys", None)
    if keys is None or keys.device.type != "cpu" or keys.dtype not in prompt_attention.TYPES:
        return False
    return keys.shape[-1] <= prompt_attention.MAX_DIM


class PackedStep:
    """One forward of `input_ids` [1, tokens] at `position_ids` [1, tokens], token t
    writing column `columns[t]` of row `rows[t]` and reading columns [lo, hi) of that row
    (`mask`: [2, tokens], the bounds); the logits of the tokens `keep` lists [kept, vocab].
    Compiled (`compiled_step.CompiledCpuStep`) as one graph of any token count up to
    `cpu_linear.MAX_ROWS` and any cache size."""

    compiled = True
    compile_key = ("packed",)
    compile_what = "prompts riding in decode steps"

    def __init__(self, model, cache, input_ids, position_ids, rows, columns, mask, keep):
        self._model, self._rows = model, cache
        self._cache = cache_argument(model, cache.cache)
        self.input_ids, self.position_ids = input_ids, position_ids
        self.rows, self.columns, self.mask, self.keep = rows, columns, mask, keep
        self.cache_position = torch.arange(input_ids.shape[1], device=input_ids.device)

    def dynamic_dims(self) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
        """The tokens, the kept logits, and the cache's rows held and columns."""
        dims = [(self.input_ids, (1,)), (self.position_ids, (1,)), (self.mask, (1,))]
        dims += [(t, (0,)) for t in (self.rows, self.columns, self.keep, self.cache_position)]
        for layer in self._rows.cache.layers:
            dims += [(layer.all_keys, (0, 2)), (layer.all_values, (0, 2))]
        return dims

    def __call__(self) -> torch.Tensor:
        window = self._rows.window
        window.rows, window.columns = self.rows, self.columns
        try:
            out = self._model(
                input_ids=self.input_ids,
                attention_mask=_NO_MASK,
                position_ids=self.position_ids,
                **self._cache,
                cache_position=self.cache_position,
                use_cache=True,
                logits_to_keep=self.keep,
                offload_rows=self.rows,
                offload_bounds=self.mask,
            )
        finally:
            window.rows = None
        return out.logits[0]


def packed_logits(runner, rows: list, chunks: list[tuple]):
    """`mixed_step.packed_forward` of `rows` and `chunks` as the compiled packed step,
    where it runs compiled now: the rows' logits [rows, vocab] and each chunk's as a
    prefill returns them. None where it does not (more tokens than the graph takes, its
    load or compile still under way): the caller runs the eager forward."""
    compiled = runner.model.compiled
    tokens = len(rows) + sum(end - start for _, start, end in chunks)
    if compiled is None or tokens > cpu_linear.MAX_ROWS:
        return None
    step = _step_of(runner, rows, chunks)
    if not compiled.usable(step):
        return None
    try:
        with prompt_attention.one_forward() as forward:
            logits = compiled(step)
    except NotPassedOn as error:  # (its columns are written again by the eager forward)
        log.warning("prompts ride in eager decode steps: %s", error)
        runner.packed_steps = False
        return None
    if logits is None:  # (its graph loads or compiles in the background)
        return None
    runner.model.on_forward(compiled.usable(step))
    return parted(runner, rows, chunks, logits, forward.exact)


def parted(runner, rows: list, chunks: list[tuple], logits, exact: bool):
    """After a forward of `rows`' decode step and `chunks` whose logits are `logits` [rows
    + kept, vocab] (`exact`: its attention all the prompt kernel's): each row moved on,
    and the rows' logits [rows, vocab] and each chunk's as a prefill returns them."""
    for row in rows:
        row.advance(exact and runner.decodes_as_prefills)
    found, at = [], len(rows)
    for group, start, end in chunks:
        kept = end - start if group.every_position else 1
        chunk = logits[at : at + kept]
        found.append(chunk[None] if group.every_position else chunk)
        at += kept
    return logits[: len(rows)], found


def _step_of(runner, rows: list, chunks: list[tuple]) -> PackedStep:
    """The packed step of `rows`' new tokens (row i of the cache each, at its column) and
    `chunks` (group, start, end: columns [start, end) of the group's prompt, in its first
    row), each token reading its row from where its prompt begins up to its own column."""
    ids, positions, token_rows, columns, lo = [], [], [], [], []
    for index, row in enumerate(rows):
        at = min(row.column, runner.max_len - 1)  # (a finished row rewrites its last)
        ids.append(row.input_token)
        positions.append(at - row.start)
        token_rows.append(index)
        columns.append(at)
        lo.append(row.start)
    keep = list(range(len(rows)))
    for group, start, end in chunks:
        chunk_ids, _, chunk_positions = runner.chunk_of(group, start, end)
        first = len(ids)
        ids += chunk_ids
        positions += chunk_positions.tolist()
        token_rows += [group.first] * (end - start)
        columns += range(start, end)
        lo += [group.rows[0].start] * (end - start)
        keep += range(first, len(ids) - 1) if group.every_position else ()
        keep.append(len(ids) - 1)
    runner.cache.forward_writes(max(columns) + 1)
    device = runner.model.device
    columns_t = torch.tensor(columns, device=device)
    bounds = torch.stack([torch.tensor(lo, device=device), columns_t + 1])
    return PackedStep(
        runner.model.model, runner.cache, torch.tensor([ids], device=device),
        torch.tensor([positions], device=device), torch.tensor(token_rows, device=device),
        columns_t, bounds, torch.tensor(keep, device=device),
    )  # fmt: skip


def warm_up_step(runner) -> PackedStep:
    """A packed step of two padding tokens (row 0's column past `max_len`, which no mask
    reads), whose call starts the graph's load or compile."""
    device, pad = runner.model.device, runner.model.pad_id
    columns = torch.full((2,), runner.max_len, device=device)
    bounds = torch.tensor([[0, 0], [1, 1]], device=device)
    zeros = torch.zeros(2, dtype=torch.long, device=device)
    return PackedStep(
        runner.model.model, runner.cache, torch.full((1, 2), pad, device=device),
        zeros[None], zeros, columns, bounds, torch.arange(2, device=device),
    )  # fmt: skip
