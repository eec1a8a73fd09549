"""The engine core's step runner: the forwards the scheduler decides, over a `RowCache` —
a chunk of one request's prompt prefilled into its rows, or one decode step of every
running row (compiled where the model has a compiled step, else eager)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from offload.engine import cpu_linear, invariant, packed_step, prompt_attention
from offload.engine.cpu_linear import kernels_for, row_invariant
from offload.engine.kv_room import Keep, Moves
from offload.engine.mixed_step import can_mix, packed_forward, rows_reading
from offload.engine.packed_step import sdpa_like
from offload.engine.prompt_attention import prompt_kernels
from offload.engine.requests import EngineModel, Group, Row
from offload.engine.row_graphs import RowGraphs
from offload.engine.rows import MIN_ROWS, RowCache, RowStep, read_width
from offload.engine.spec_tree import Tree, moves, verify_layout
from offload.engine.transformers_cache import cache_argument
from offload.engine.verify_attention import verifying
from offload.quant.kernels import rows_apart
from offload.sizes import compute_dtype


class StepRunner:
    """Runs `model`'s forwards over a cache of `max_rows` rows of `max_len` positions.
    `invariant`: batch invariance (`invariant.py`): every step runs the eager products the
    model's linears were padded for (no kernel chosen by row count, no compiled step),
    reading every column. `graphs(held_rows)`: the `RowGraphs` its decode steps replay
    (CUDA graphs; not with KV offload, whose copies follow each step's columns)."""

    # Whether a decode step that took the prefill's attention kernel in this process
    # computed all of its rows' keys and values (so prefix caching may reuse an answer):
    # not where other ranks compute some layers (`PipelinedRunner`).
    decodes_as_prefills = True

    def __init__(
        self,
        model: EngineModel,
        max_rows: int,
        max_len: int,
        kv_dims=None,
        invariant=False,
        host_pool=None,
        graphs: Callable[[int], RowGraphs] | None = None,
    ):
        self.model = model
        dtype = compute_dtype(model.model)
        hf_config, device = model.model.config, model.device
        # (`host_pool`: the rows' keys and values in host memory, KV offload)
        held = getattr(model.model, "held_layers", None)  # (a pipeline stage's layers)
        self.cache = RowCache(hf_config, max_rows, max_len, dtype, device, kv_dims, host_pool, held)
        self.max_len = max_len
        self.invariant = invariant
        self.keep_form = False  # (see `decode`: each answer eager or compiled throughout)
        self._last: RowStep | None = None  # the last decode step, refilled where it can be
        self.graphs = None
        if graphs is not None and host_pool is None and not invariant:
            self.graphs = graphs(self.cache.held)
        # (not batch invariant: its prompts are prefilled alone, by the prefill's products)
        self.mixes = not invariant and can_mix(model.model, self.cache)
        # Prompts admitted in one turn prefill in one forward where that gives each the bits
        # of its prefill alone: a CPU's row-invariant products (`prompt_kernels`).
        cpu = torch.device(model.device).type == "cpu"
        self.packs = self.mixes and cpu and row_invariant(model.model)
        # A turn's rows and prompt tokens as one compiled step (`packed_step`)
        self.packed_steps = self.packs and model.compiled is not None
        self.packed_steps = self.packed_steps and packed_step.takes(model.model, self.cache)
        if self.packed_steps:
            packed_step.use(model.model)

    def move_rows(self, moves: Moves) -> None:
        """What the scheduler decided, in order: row moves, memory given back."""
        for move in moves:
            if isinstance(move, Keep):
                self.cache.keep(move.row, move.columns)
            else:
                self.cache.move_row(*move)

    def release(self, keep: list[int] | None = None) -> None:
        """The memory the rows wrote given back but each row's first `keep[row]` columns
        (`RowCache.release`)."""
        self.cache.release(keep)

    def close(self) -> None:
        """The cache's copies ended (KV offload's thread)."""
        self.cache.close()

    def copy_prompt(self, group: Group) -> None:
        """The prompt prefilled in `group`'s first row into its other rows."""
        for index in range(1, len(group.rows)):
            self.cache.move_row(group.first, group.first + index, group.width)

    def prefill(self, group: Group, start: int, end: int) -> torch.Tensor:
        """Columns [start, end) of `group`'s prompt into its first row (its other rows,
        of the same prompt, copy it once it is whole: `copy_prompt`), so that the prompt
        runs as it would alone; the logits of the last column [1, vocab], or of every
        column [1, tokens, vocab] where the request asks for its prompt's logprobs."""
        device = self.model.device
        row = group.rows[0]
        ids, columns, positions = self.chunk_of(group, start, end)
        input_ids = torch.tensor([ids], device=device)  # [1, tokens]
        width = self.reading_width(group.width)
        every = torch.arange(width, device=device)
        mask = ((every >= row.start) & (every < group.width)).long()[None, :]  # [1, width]
        self.cache.select(group.first, group.first + 1, columns[None, :], start, width)
        self.cache.forward_writes(end)
        model = self.model.model
        if self.cache.masks is not None:  # (sliding windows: the query columns are true here)
            shift = torch.zeros(1, dtype=torch.long, device=device)
            mask = self.cache.masks(
                model, mask, end - start, shift, self.cache.cache, self.cache.dtype
            )
        with torch.inference_mode(), prompt_kernels(model, device):
            out = model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions[None, :],
                **cache_argument(model, self.cache.cache),
                cache_position=columns,
                use_cache=True,
                logits_to_keep=0 if group.every_position else 1,
            )
        self.model.on_forward(False)
        return out.logits if group.every_position else out.logits[:, -1, :]

    def packed(self, rows: list[Row], chunks: list[tuple[Group, int, int]]):
        """One forward of `rows`' decode step (rows [0, len) of the cache) and columns
        [start, end) of each of `chunks`' groups' prompts (`mixed_step`): the rows' logits
        [rows, vocab] and each chunk's as `prefill` returns them; None where they cannot
        share a forward now (a compile is tracing the model: the caller runs them apart)."""
        return packed_forward(self, rows, chunks)

    def prefill_packed(self, chunks: list[tuple[Group, int, int]]) -> list[torch.Tensor] | None:
        """Columns [start, end) of several groups' prompts in one forward (`packs`): each
        group's logits as `prefill` returns them, in order; None where they cannot share
        a forward now (the caller prefills them apart)."""
        out = packed_forward(self, [], chunks)
        return None if out is None else out[1]

    @torch.inference_mode()
    def verify(self, rows: list[Row], guesses: list) -> torch.Tensor:
        """One forward of `rows` (rows [0, len) of the cache), each fed its next token
        and then its guesses (speculative decoding: a list, a chain, or a `spec_tree.Tree`),
        written at its next columns: logits [rows, 1 + most guesses, vocab], query j of a
        row scoring the token after its j-th input (a tree's node j - 1). A row with fewer
        guesses is padded with queries that write the column past `max_len` (their logits
        mean nothing); a row whose guesses are None is fed nothing (padding only). Eager."""
        device, model = self.model.device, self.model.model
        trees = [g if g is None or isinstance(g, Tree) else Tree.chain(g) for g in guesses]
        laid = verify_layout(rows, trees, self.max_len, self.reading_width, device)
        num, width = laid.reading.shape[1], laid.mask.shape[-1]
        self.cache.select(0, len(rows), laid.columns, width - num, width)  # (the 4D mask rules)
        self.cache.forward_writes(laid.high)
        # Each position's attention and q8 products as the lone row's decode step runs them
        widths = [[read_width(c + 1, self.max_len) for c in row] for row in laid.positions.tolist()]
        compiled = self.model.compiled
        jobs = None if compiled is None else compiled.running
        masks = self._verify_masks(laid.mask, laid.reading)  # (before `verifying` renames it)
        tree = (laid.decode_mask[:, None], laid.gathers, [row.column for row in rows])
        attention = self._step_attention(apart=False)  # (as the decode steps')
        with self.kernels(), rows_apart(), verifying(model, widths, jobs, tree), attention:
            out = model(
                input_ids=torch.tensor(laid.ids, device=device),
                attention_mask=masks,
                position_ids=laid.positions
                - torch.tensor([r.start for r in rows], device=device)[:, None],
                **cache_argument(model, self.cache.cache),
                cache_position=torch.arange(width - num, width, device=device),
                use_cache=True,
                logits_to_keep=0,
            )
        self.model.on_forward(False)
        return out.logits

    def keep_paths(self, rows: list[Row], paths: list[list[int]]) -> None:
        """After a verify forward of trees: each row's kept nodes' KV columns moved to its
        next columns in order (`spec_tree.moves`; a chain's are there already)."""
        for index, (row, path) in enumerate(zip(rows, paths, strict=True)):
            pairs = [(row.column + a, row.column + b) for a, b in moves(path)]
            if pairs:
                self.cache.move_columns(index, pairs)

    @property
    def takes_trees(self) -> bool:
        """Whether a verify forward here takes trees (not where layers slide: their
        windows count columns, and a tree's columns are not its positions)."""
        return self.cache.masks is None

    def _verify_masks(self, mask: torch.Tensor, reading: torch.Tensor):
        """The 4D masks [rows, 1, queries, width] a verify forward passes (transformers
        takes a 4D mask as it is): `mask` where no layer slides, and each sliding layer's
        window applied from its query's own column (one mask per layer type where only
        some slide); additive where the model's attention is not SDPA's."""
        masks = self.cache.masks
        kinds = {"full_attention": mask}
        if masks is not None:
            every = torch.arange(mask.shape[-1], device=mask.device)[None, None, :]
            kinds["sliding_attention"] = mask & (every > reading[:, :, None] - masks.window)
        if not sdpa_like(self.model.model.config):
            zero = torch.zeros((), dtype=self.cache.dtype, device=mask.device)
            low = torch.tensor(torch.finfo(self.cache.dtype).min, device=mask.device)
            kinds = {kind: torch.where(m, zero, low) for kind, m in kinds.items()}
        kinds = {kind: m[:, None] for kind, m in kinds.items()}
        if masks is None:
            return kinds["full_attention"]
        if masks.layer_types is None:
            return kinds["sliding_attention"]
        return {kind: kinds[kind] for kind in masks.layer_types}

    @torch.inference_mode()
    def decode(self, rows: list[Row]) -> torch.Tensor:
        """One decode step of `rows` (rows [0, len) of the cache): logits [rows, vocab].
        Each row's column then moves on if it is live."""
        if self.graphs is not None:  # (CUDA graphs: the rows padded to the graph's)
            step = self.row_step(rows, pad_to=self.graphs.rows_for(len(rows)))
            logits, counted = self.graphs.run(step, self._eager), False
            exact = False
        else:
            with prompt_attention.one_forward() as forward:
                logits, counted = self._step(rows)
            exact = forward.exact and self.decodes_as_prefills
        self.model.on_forward(counted)
        for row in rows:
            row.advance(exact)
        return logits[: len(rows)]  # (less the padding rows)

    def _step(self, rows: list[Row]) -> tuple[torch.Tensor, bool]:
        """A decode step of `rows` compiled (where it can be) or eager; its logits, and
        whether the compiled step ran it."""
        # (its inputs made in inference mode, as the warm-up's: a compiled step's guards
        # check each input's dispatch keys, and a step made outside it missed the graph)
        step = self.row_step(rows, pad_to=self._lone_pad())
        self.cache.forward_writes(max(min(row.column, self.max_len - 1) for row in rows) + 1)
        compiled, logits, counted = self.model.compiled, None, False
        wanted = compiled is not None and step.compiled and compiled.usable(step)
        # With `keep_form`, an answer runs in one form: one begun eagerly while its step
        # compiled in the background ends eagerly, and so do the steps it shares (set
        # where the compiled step's bits may differ from the eager step's, `llm/cores.py`:
        # a switch midway made an answer depend on when the compile ended). Off for a
        # server: eager rows made every row that shared a step with them eager too, so
        # steady traffic never reached the compiled step (docs/benchmarks.md).
        eager_rows = self.keep_form and any(row.eager for row in rows if row.is_live)
        if wanted and not eager_rows:
            # (None while it compiles in the background; a kept step's guards checked once
            # for a step refilled in place over weights and a cache that stay put)
            in_place = self.model.weights_in_place and self.cache.kv_offloader is None
            if not compiled.ready(step):  # (a call that compiles marks its tensors' sizes
                self._last = None  # dynamic, which a kept step's guards refuse: not reused)
            logits = compiled(step, in_place and step is self._last)
            counted = logits is not None and compiled.usable(step)  # (known after a call)
        if logits is None and wanted:
            for row in rows:
                row.eager = True
        if logits is None:
            # (padding rows count: a batch's attention splits as the compiled step's does)
            batch = step.columns.shape[0]
            with invariant.decoding(batch) if self.invariant else self._decoding(batch):
                logits = step()
        return logits, counted

    def _eager(self, step: RowStep) -> torch.Tensor:
        with self._decoding(step.columns.shape[0]):
            return step()

    def forget_step(self) -> None:
        """The next decode step is made anew (its guards checked again, if compiled)."""
        self._last = None

    def row_step(self, rows: list[Row], pad_to: int = 0) -> RowStep:
        """The decode step of `rows`: compiled where the model has a compiled step and
        there are at most `cpu_linear.MAX_ROWS` of them. `pad_to`: padding rows up to
        that many (copies of the first row, or of an empty one), which write only the
        column past `max_len` (the warm-up's step is all padding)."""
        device = self.model.device
        last = [row.input_token for row in rows]
        # (a finished row still in the batch rewrites its last column: never past the end)
        at = [min(row.column, self.max_len - 1) for row in rows]
        starts = [row.start for row in rows]
        width = self.reading_width(max(at, default=0) + 1)
        pad = max(pad_to - len(rows), 0)
        compiled = len(rows) + pad <= cpu_linear.MAX_ROWS
        compiled = compiled and self.model.compiled is not None and not self.invariant
        last, at, starts = ([*values, *(values or [0])[:1] * pad] for values in (last, at, starts))
        columns, start, mask = rows_reading(at, starts, width, device)
        mask = mask.long()
        positions = columns - start
        columns[len(rows) :] = self.max_len  # padding rows write past what is read
        input_ids = torch.tensor(last, device=device)[:, None]
        inputs = (input_ids, mask, positions, columns)
        reused = self._last
        if reused is not None and reused.compiled == compiled and reused.mask.shape == mask.shape:
            # The last step's tensors refilled: the same object, of the same sizes, as a
            # compiled step checks its guards for once (`CompiledCpuStep`, `checked_once`).
            for mine, new in zip(reused.inputs, inputs, strict=True):
                mine.copy_(new)
            return reused
        step = RowStep(self.model.model, self.cache, *inputs, compiled)
        self._last = step
        return step

    def warm_up(self) -> None:
        """Start the compiled decode steps (a lone row's and the batches', with padding
        rows only) now, before a request meets them: loaded or compiled in the background
        (steps run eagerly until then), or here where they compile in the foreground
        (`OFFLOAD_CPU_COMPILE=wait`)."""
        if self.model.compiled is None or self.invariant:
            return
        with self.model.lock, torch.inference_mode():
            for rows in (1, MIN_ROWS) if not self._lone_pad() else (MIN_ROWS,):
                self.model.compiled(self.row_step([], pad_to=rows))
                self._last = None  # (see `decode`)
            if self.packed_steps:  # (and the turns in which prompts ride)
                self.model.compiled(packed_step.warm_up_step(self))

    def _lone_pad(self) -> int:
        """Rows a compiled decode step is padded to: `MIN_ROWS` where the products are
        row-invariant, so a lone row runs in the batches' graph (one of its own fuses
        otherwise, and its bits would part from a batch's), else 0."""
        cpu = self.model.device.type == "cpu"
        compiled = self.model.compiled is not None and not self.invariant
        return MIN_ROWS if compiled and cpu and row_invariant(self.model.model) else 0

    def chunk_of(self, group: Group, start: int, end: int):
        """Columns [start, end) of `group`'s prompt as its first row takes them: their
        token ids, columns [tokens] and positions [tokens]."""
        row = group.rows[0]
        ids = [self.model.pad_id] * row.start + row.prompt_ids
        columns = torch.arange(start, end, device=self.model.device)
        return ids[start:end], columns, (columns - row.start).clamp(min=0)

    def reading_width(self, num_columns: int) -> int:
        """The columns attention reads; every one in batch-invariant mode (how many there
        are changes how its sums group, and the others' lengths would set it)."""
        return self.max_len if self.invariant else read_width(num_columns, self.max_len)

    @contextlib.contextmanager
    def _decoding(self, rows: int):
        """An eager decode step of `rows` rows: `kernels`; on a CPU attention in the
        prefill's kernel (`invariant.StepAttention`), or where it does not take a call, one
        sequence at a time where the products are row-invariant (ATen's kernel splits work
        by batch)."""
        apart = rows > 1 and row_invariant(self.model.model)
        with self.kernels(), self._step_attention(apart):
            yield

    def _step_attention(self, apart: bool):
        """A decode step's attention: on a CPU the prefill's kernel (`StepAttention`)."""
        if self.model.device.type != "cpu":
            return contextlib.nullcontext()
        return invariant.StepAttention(apart)

    def kernels(self):
        """On a CPU a batch's linears run as weight @ x.T (see cpu_linear: MKL repacks the
        weight for a few rows) where the float32 weights are large enough for it to pay.
        (A batch-invariant decode step runs in `invariant.decoding` instead.)"""
        return kernels_for(self.model.model, self.model.device)
