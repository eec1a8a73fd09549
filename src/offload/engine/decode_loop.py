"""The decode loop of `LLM`: prompts into sequences, batches of them through a static KV
cache (prefill in chunks, then one token per step, eagerly or as CUDA graph replays),
and the bytes each call moved added to the running totals."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from offload.engine import cpu_linear, cpu_step
from offload.engine.compiled_step import CompiledCpuStep
from offload.engine.cpu_linear import kernels_for
from offload.engine.cpu_step import cache_length
from offload.engine.graphs import DecodeGraphs, DecodeStep
from offload.engine.kv_cache import KVHostPool, KVOffloader
from offload.engine.request_maker import RequestMaker
from offload.engine.sampling_params import SamplingParams
from offload.engine.sequences import (
    Batch,
    RequestOutput,
    RequestProgress,
    SequenceState,
    completion_of,
    per_prompt,
)
from offload.engine.tokens import TokenSteps
from offload.engine.transfer_stats import TransferStats
from offload.engine.transformers_cache import cache_argument, probe_kv_dims, static_cache
from offload.errors import ConfigError, ModelError
from offload.memory.kv_shape import check_host_kv, kv_shape_of
from offload.offloader.base import BaseOffloader
from offload.offloader.hooks import attach_boundaries
from offload.offloader.layers import find_layers
from offload.sizes import compute_dtype


class DecodeLoop:
    """What `LLM` runs for `generate` and `chat`, once their arguments are checked. It
    reads the state `LLM.__init__` sets up: the model, its offloader and device, the
    tokens, the limits, the KV cache settings and the running totals."""

    model: torch.nn.Module
    offloader: BaseOffloader
    tokenizer: Any
    device: torch.device
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int | None
    max_logprobs: int
    kv_offload: bool
    swap_space_bytes: int
    _tokens: TokenSteps
    _requests: RequestMaker  # the one check of a prompt and its limits
    _kv_pool: KVHostPool
    _prefill_kv_pool: KVHostPool  # (a prompt's own cache, `_prefill_each`, beside the batch's)
    _kv_dims: tuple | None
    _use_graphs: bool
    _compile_cpu: bool  # a compiled decode step on a CPU where it pays (not enforce_eager)
    _kv_room_bytes: int | None  # a budget's room for the KV cache (on a CPU), None: no bound
    _cpu_step: CompiledCpuStep | None  # made on first use
    _moved: TransferStats
    _forwards: int
    _compiled_steps: int
    _on_step: Callable[[list[SequenceState]], None] | None

    def _generate(self, prompts, ids, sampling_params, use_tqdm=False) -> list[RequestOutput]:
        params = per_prompt(sampling_params, len(prompts))
        ids = [self._requests.truncate(i, p) for i, p in zip(ids, params, strict=True)]
        for prompt_ids, request in zip(ids, params, strict=True):  # all before any work
            self._requests.check(prompt_ids, request)
        sequences = self._sequences(ids, params)
        if sequences:
            progress = RequestProgress(sequences, use_tqdm)
            try:
                for batch in self._batches(sequences):
                    self._decode(batch, progress)
            finally:
                progress.close()
        return _outputs(prompts, ids, params, sequences)

    def _batches(self, sequences: list[SequenceState]):
        """Consecutive batches of at most max_num_seqs sequences, as vLLM schedules them,
        and no more than a budget's KV room holds (one sequence always fits: the budget
        set one aside, of max_model_len positions)."""
        start = 0
        while start < len(sequences):
            count = min(self.max_num_seqs, len(sequences) - start)
            while count > 1 and not self._kv_fits(sequences[start : start + count]):
                count -= 1
            yield sequences[start : start + count]
            start += count

    def _kv_fits(self, sequences: list[SequenceState]) -> bool:
        if self._kv_room_bytes is None:
            return True
        # (a compiled step's cache is rounded up: counted so, whether it compiles or not)
        length = cache_length(Batch.length_of(sequences), self.max_model_len)
        shape = kv_shape_of(self.model.config, len(sequences), length, compute_dtype(self.model))
        return shape.layer_bytes * self.model.config.num_hidden_layers <= self._kv_room_bytes

    def _sequences(self, ids: list[list[int]], params: list[SamplingParams]) -> list[SequenceState]:
        """`n` sequences per prompt, in order; a request's sequences share its generator."""
        sequences = []
        for index, (prompt_ids, request) in enumerate(zip(ids, params, strict=True)):
            sequences += self._requests.sequences(prompt_ids, request, index)
        return sequences

    @torch.inference_mode()
    def _decode(self, sequences: list[SequenceState], progress: RequestProgress) -> None:
        """All sequences as one left-padded batch in a static KV cache (fixed shapes, the
        shape CUDA-graph decode needs): a prefill, then one token per step."""
        compiled = self._compiled_step(len(sequences))
        room = (lambda n: cache_length(n, self.max_model_len)) if compiled else (lambda n: n)
        if compiled and not self._host_kv_fits(len(sequences), room(Batch.length_of(sequences))):
            compiled, room = None, (lambda n: n)  # the rounded cache would pass swap_space
        batch = Batch.of(sequences, self.tokenizer.pad_token_id, self.device, room)
        cache = self._make_cache(len(sequences), batch.columns.numel())
        graphs = None
        try:
            graphs = self._decode_steps(sequences, batch, cache, progress, compiled, room)
        finally:
            self._count_moved(cache.kv_offloader, graphs)
        for sequence in sequences:
            if sequence.finish_reason is None:
                sequence.finish_reason = "length"

    def _compiled_step(self, num_sequences: int) -> CompiledCpuStep | None:
        """The compiled CPU step where it pays (`cpu_step.pays`), for a batch of 1 to
        `cpu_linear.MAX_ROWS` sequences (those whose products it writes, `step_linear`;
        weights kept as stored keep their own products, the rest of the step fuses: the
        default model as stored, whose server steps of 2-32 rows run faster compiled than
        eager; docs/benchmarks.md, "2026-11-28 (twenty-first session): the server's few-row
        steps, and the default model's steps as stored (issue 28)")."""
        if not self._compile_cpu or not cpu_step.enabled():
            return None
        if num_sequences > cpu_linear.MAX_ROWS or not cpu_step.pays(self.model):
            return None
        if self._cpu_step is None:
            self._cpu_step = CompiledCpuStep()
            with contextlib.suppress(ModelError):  # (no layer stack: nothing offloads either)
                attach_boundaries(find_layers(self.model))
        return self._cpu_step

    def _step_kernels(self):
        """On a CPU a decode step's linears run as `cpu_linear` has them (a batch of
        matrix-vector products for one row, `weight @ x.T` for a few): the weight streamed
        at the read rate instead of MKL's one-thread rate, where the model's float32
        linears are large enough for that to pay (`kernels_for`)."""
        return kernels_for(self.model, self.device)

    def _count_moved(self, kv: KVOffloader | None, graphs: DecodeGraphs | None) -> None:
        """Add what this call moved to the running totals (graph replays included)."""
        if kv is not None:
            kv.close()
            self._moved += TransferStats.of(kv=kv.stats())
        if graphs is not None:
            self._moved += graphs.replayed

    def _host_kv_fits(self, batch: int, length: int) -> bool:
        """Whether a host KV cache of `length` positions fits swap_space (or none is used)."""
        if not self.kv_offload:
            return True
        config, dtype = self.model.config, compute_dtype(self.model)
        shape = kv_shape_of(config, batch, length, dtype, self._probed_kv_dims())
        try:
            check_host_kv(
                shape, config.num_hidden_layers, self.swap_space_bytes, self._kv_pool.num_bytes
            )
        except ConfigError:
            return False
        return True

    def _probed_kv_dims(self):
        if self._kv_dims is None:  # once: what the attention layers really cache
            self._kv_dims = (probe_kv_dims(self.model),)
            self._forwards += 1  # the probe is a forward of the whole model too
        return self._kv_dims[0]

    def _make_cache(self, batch: int, length: int, host_pool: KVHostPool | None = None):
        dtype = compute_dtype(self.model)
        dims = None
        if self.kv_offload:
            dims = self._probed_kv_dims()
            shape = kv_shape_of(self.model.config, batch, length, dtype, dims)
            layers = self.model.config.num_hidden_layers
            check_host_kv(shape, layers, self.swap_space_bytes, self._kv_pool.num_bytes)
        return static_cache(
            self.model.config,
            batch,
            length,
            dtype,
            self.device,
            offload=self.kv_offload,
            host_pool=host_pool or self._kv_pool,
            kv_dims=dims,
        )

    def _prefill(self, batch: Batch, positions, cache, every_position: bool) -> torch.Tensor:
        """The prompts through the model, `max_num_batched_tokens` at a time (chunked
        prefill, as vLLM's: activations grow with the chunk, not the prompt); the logits
        of the last position, or of every position for prompt logprobs."""
        width = batch.width
        step = width if self.max_num_batched_tokens is None else self.max_num_batched_tokens
        step = max(1, step // len(batch.starts))  # columns per chunk, over the whole batch
        chunks = []
        for start in range(0, width, step):
            end = min(start + step, width)
            out = self.model(
                input_ids=batch.input_ids[:, start:end],
                attention_mask=batch.mask,  # the whole cache length, as decode (ALiBi needs it)
                position_ids=positions[:, start:end],
                **cache_argument(self.model, cache),
                cache_position=batch.columns[start:end],
                use_cache=True,
                logits_to_keep=0 if every_position else 1,
            )
            chunks.append(out.logits)
            self._forwards += 1
        return torch.cat(chunks, dim=1) if every_position else chunks[-1]

    def _prefill_each(self, sequences, batch: Batch, cache, every_position: bool, room):
        """The batch's prompts through the model, each distinct one as it runs alone (its
        own one-row cache, then copied into its rows of `cache`: `row_prefill`), so that
        a prompt's logits do not depend on the prompts beside it; logits [batch, columns,
        vocab], right-aligned as the grouped prefill's. A cache of other layer kinds
        (sliding windows) keeps the grouped prefill."""
        from offload.engine import row_prefill  # (imports transformers)

        if len(sequences) == 1 or not row_prefill.copyable(cache):
            positions = (batch.columns[None, : batch.width] - batch.starts[:, None]).clamp(min=0)
            return self._prefill(batch, positions, cache, every_position)
        rows_of: dict[tuple[int, ...], list[int]] = {}
        for row, sequence in enumerate(sequences):
            rows_of.setdefault(tuple(sequence.prompt_ids), []).append(row)
        width, out = batch.width, None
        for rows in rows_of.values():
            alone = Batch.of([sequences[rows[0]]], self.tokenizer.pad_token_id, self.device, room)
            own = self._make_cache(1, alone.columns.numel(), self._prefill_kv_pool)
            try:
                positions = alone.columns[None, : alone.width]
                logits = self._prefill(alone, positions, own, every_position)
            finally:
                self._count_moved(own.kv_offloader, None)  # (and its writes have landed)
            if out is None:
                shape = (len(sequences), width if every_position else 1, logits.shape[-1])
                out = logits.new_zeros(shape)
            for row in rows:
                row_prefill.place(own, cache, row, width - alone.width, len(sequences))
                out[row, out.shape[1] - logits.shape[1] :] = logits[0]
        row_prefill.written(cache, width)
        return out

    def _decode_steps(
        self,
        sequences: list[SequenceState],
        batch: Batch,
        cache,
        progress: RequestProgress,
        compiled: CompiledCpuStep | None,
        room: Callable[[int], int],
    ) -> DecodeGraphs | None:
        """The prefill, then one token per step: the first decode step eagerly (it also
        warms up), the rest as CUDA graph replays on a GPU unless `enforce_eager`; on a
        CPU, compiled where that pays (`compiled`)."""
        positions = (batch.columns[None, : batch.width] - batch.starts[:, None]).clamp(min=0)
        every_position = any(s.params.prompt_logprobs is not None for s in sequences)
        logits = self._prefill_each(sequences, batch, cache, every_position, room)
        if every_position:
            self._tokens.prompt_logprobs(logits, sequences, batch.width)
        logits = logits[:, -1, :]  # [batch, vocab]
        step = DecodeStep(self.model, cache, batch.mask, positions)
        graphs, position = None, batch.width  # where the newest token goes
        in_place = self.offloader.weights_in_place and cache.kv_offloader is None
        # An answer runs in one form: begun eagerly while its step compiles in the
        # background, it ends eagerly (the compiled step's bits may differ from the eager
        # step's: a switch midway made an answer depend on when the compile ended).
        eager_answer = False
        while True:
            tokens = self._tokens.pick(logits, sequences)
            progress.update()
            # The text so far is position + 1 long.
            done = all(s.finish_reason is not None for s in sequences)
            done = done or position + 1 >= batch.length
            # A stream waits for a step about to compile: its lines would cut the text.
            if self._on_step is not None and (
                done or compiled is None or not compiled.blocks(step)
            ):
                self._on_step(sequences)
            if done:
                return graphs
            step.prepare(tokens, position)
            if graphs is None and self._use_graphs and position > batch.width:
                graphs = DecodeGraphs(step, self.offloader, cache.kv_offloader)
            logits = None
            if graphs is not None:
                logits = graphs.run(position + 1)
            elif compiled is not None and compiled.usable(step) and not eager_answer:
                # (the same step object all loop long, its weights staying put: the
                # kept step's guards are checked at its first call only); None while
                # it compiles in the background
                logits = compiled(step, in_place)
                if logits is not None:  # (whether it counts is known after its first call)
                    self._compiled_steps += compiled.usable(step)
                eager_answer = logits is None
            if logits is None:
                with self._step_kernels():
                    logits = step()
            self._forwards += 1
            position += 1


def _outputs(prompts, ids, params, sequences: list[SequenceState]) -> list[RequestOutput]:
    """One `RequestOutput` per prompt, with its `n` completions."""
    outputs, start = [], 0
    for number, (prompt, prompt_ids, request) in enumerate(zip(prompts, ids, params, strict=True)):
        group = sequences[start : start + request.n]
        start += request.n
        completions = [completion_of(i, s) for i, s in enumerate(group)]
        outputs.append(
            RequestOutput(
                str(number),
                prompt,
                prompt_ids,
                completions,
                prompt_logprobs=group[0].prompt_logprobs if group else None,
            )
        )
    return outputs
