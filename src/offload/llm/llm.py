"""`LLM`: vLLM's offline API (`generate`, `chat`) over an offloaded Hugging Face model."""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from offload.config import OffloadConfig
from offload.config.limits import GPU_MEMORY_UTILIZATION
from offload.engine import cpu_step
from offload.engine.grammars import Grammars
from offload.engine.sampling_params import SamplingParams
from offload.engine.sequences import CompletionOutput, RequestOutput, SequenceState, per_prompt
from offload.engine.tokens import TokenSteps
from offload.engine.transfer_stats import TransferStats
from offload.errors import ConfigError
from offload.llm.chat import chat_token_ids
from offload.llm.checks import (
    check_token_ids,
    check_use_tqdm,
    parse_prompts,
    serialized,
    vocab_limit,
)
from offload.llm.cores import generator_of, serving_engine
from offload.llm.engine_args import EngineArgs
from offload.llm.generating import Generating, core_moved
from offload.llm.serving import Serving
from offload.llm.spec import ModelSpec
from offload.llm.start import start_llm
from offload.memory.host import trim_after_collection, trim_freed_memory
from offload.memory.placement import AUTO
from offload.memory.threads import check_not_forked
from offload.offloader import ops


class LLM:
    """Load a model with offloading in place and generate text, as vLLM's `LLM` does.

    `model` is a Hugging Face model directory with safetensors weights (default: the
    bundled SmolLM2-135M-Instruct), or a `ModelSpec` made beforehand
    (`offload.llm.spec.model_spec`: it is not resolved again, and its device and dtype are
    used). The arguments are checked as one record first (`EngineArgs`). Offloading is set by an `offload_config`
    (`OffloadConfig` or dict) or by vLLM's keyword names: `cpu_offload_gb`,
    `cpu_offload_params`, `offload_backend`, `offload_group_size`,
    `offload_num_in_group`, `offload_prefetch_step`, `offload_params`.
    `cpu_offload_gb="auto"` with no backend or layout given leaves the choice to the
    planner (`offload plan`): from this machine's measured rates (measured once per model
    shape and cached) it picks what stays on the device, what streams with prefetch, what
    UVA reads and what stays on disk (under `cpu_memory_gb`), and the engine runs the
    fastest that fits; `offload_config` says what it chose.

    The KV cache lives in host memory, layer by layer brought to the device ahead of
    use, with `kv_offload=True` or `swap_space` > 0 (GiB of host memory it may take;
    unlike vLLM's preemption swap space, which this engine has no use for, it holds the
    cache itself). `device_memory_gb` emulates a smaller device.

    `batch_invariant=True` (vLLM's VLLM_BATCH_INVARIANT=1 sets the default) makes each
    prompt's tokens and logprobs the same alone and in any batch, at a cost: eager steps,
    padded products (`engine/invariant.py`; not with `kv_offload`).

    One `LLM` may be shared by threads: their calls run one at a time, each with the
    output it would have alone. `close()` (or a `with LLM(...) as llm:` block) ends its
    copy threads and lets its memory go at once; otherwise that happens when the object
    is garbage-collected.

    As in vLLM, the checkpoint's own Python code (an `auto_map` in its config.json or
    tokenizer_config.json) runs only with `trust_remote_code=True`.
    """

    # What `start_llm` sets up (llm/loading.py), besides the arguments' limits.
    model: torch.nn.Module
    offloader: Any  # its `BaseOffloader`
    tokenizer: Any
    max_model_len: int
    _tokens: TokenSteps
    _requests: Any  # the one check of a prompt and its limits (`RequestMaker`)
    _generator: Generating | None  # generate's and chat's engine core, made on first use
    _use_graphs: bool  # CUDA graphs of the decode steps (a GPU, not enforce_eager)
    _compile_cpu: bool  # a compiled decode step on a CPU where it pays (not enforce_eager)
    _cpu_step: Any  # its `CompiledCpuStep`, made on first use (`cores.compiled_step`)
    _forwards: int
    _compiled_steps: int

    def __init__(
        self,
        model: str | Path | ModelSpec | None = None,
        *,
        dtype: str | torch.dtype = AUTO,
        quantization: str | None = None,
        device: str | torch.device = AUTO,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
        device_memory_gb: float | None = None,
        swap_space: float = 0,
        kv_cache_memory_bytes: int | None = None,
        kv_offload: bool = False,
        seed: int = 0,
        load_format: str = AUTO,
        progress: bool | None = None,
        enforce_eager: bool = False,
        max_logprobs: int = 20,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        batch_invariant: bool | None = None,
        enable_prefix_caching: bool | None = None,
        speculative_config: Mapping[str, Any] | str | None = None,
        tokenizer: str | Path | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        pipeline_micro_batches: int | None = None,
        trust_remote_code: bool = False,
        offload_config: OffloadConfig | Mapping[str, Any] | None = None,
        **offload_flags: Any,
    ):
        args = EngineArgs(**{name: value for name, value in locals().items() if name != "self"})
        self.engine_args = args
        self._lock = threading.Lock()
        self._serving_lock = threading.Lock()
        self._served: Serving | None = None
        self._pid = os.getpid()
        self._closed = False
        # Dropped without close(): its tensors are freed after this runs, so malloc's heaps
        # are trimmed at the collection that ends it (else RSS keeps what it held).
        weakref.finalize(self, trim_after_collection)
        self._on_step: Callable[[list[SequenceState]], None] | None = None  # see _streaming
        limits = args.limits
        self.max_logprobs, self.max_num_seqs, self.max_num_batched_tokens = limits[:3]
        self.trust_remote_code, self.swap_space_bytes, self.kv_offload = limits[3:6]
        self.batch_invariant = args.is_batch_invariant
        self.prefix_caching = args.prefix_caching
        self.speculative_config = args.speculative
        self.pipeline_micro_batches = args.pipeline_micro_batches  # (`micro_batches`)
        self.kv_cache_memory_bytes = limits.kv_cache_memory_bytes
        spec = args.model_spec()
        self.device = spec.device
        if cpu_step.may_compile(self.device, args.enforce_eager):
            ops.free_dropped()  # (their ids: a compiled step of this model is a kept one)
        trim_freed_memory()  # what models dropped without close() left in malloc's heaps
        start_llm(self, args, spec)

    # -- public API -------------------------------------------------------------

    @serialized
    def generate(
        self,
        prompts: str | Mapping[str, Any] | Sequence[str | Mapping[str, Any]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> list[RequestOutput]:
        """Complete each prompt; one `RequestOutput` per prompt, in order. A prompt is a
        string or, as in vLLM, {"prompt": str} or {"prompt_token_ids": [int, ...]};
        `prompts` is one prompt or any iterable of them (a list, a tuple, a generator).
        `use_tqdm` shows a bar of processed prompts (or names the tqdm class to use)."""
        check_use_tqdm(use_tqdm)
        texts, ids, encoded = parse_prompts(prompts, lambda text: self.tokenizer(text).input_ids)
        check_token_ids(ids, vocab_limit(self.model), encoded)
        return self._generate(texts, ids, sampling_params, use_tqdm)

    @serialized
    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of {"role", "content"} messages) or several,
        with the model's chat template or `chat_template`; the other arguments are
        vLLM's and go to the template (`chat_template_kwargs`, e.g. enable_thinking)."""
        check_use_tqdm(use_tqdm)
        texts, ids = chat_token_ids(
            self.tokenizer,
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
        check_token_ids(ids, vocab_limit(self.model), [True] * len(ids))
        return self._generate(texts, ids, sampling_params, use_tqdm)

    def serving(
        self,
        max_num_seqs: int | None = None,
        fixed_length: bool = False,
        engine_thread: bool = True,
    ) -> Serving:
        """This LLM's continuous-batching engine (made on first use): requests submitted
        from any thread share each step (what `offload serve` runs). Each of its
        `max_num_seqs` rows reserves KV cache for `max_model_len` positions; where that
        does not fit (`kv_cache_room`: on a CPU, what cpu_memory_gb leaves), rows are
        shorter (not with `fixed_length`), then fewer. With `engine_thread=False` the
        caller runs the engine's loop (`serving().core.run()`), e.g. on the main thread."""
        check_not_forked(self._pid, "this LLM")
        with self._serving_lock:
            if self._closed:
                raise ConfigError("this LLM is closed; make a new LLM(...) to generate again")
            if self._served is None:
                self._served = self._serving(max_num_seqs, fixed_length, engine_thread)
            return self._served

    def _serving(self, max_num_seqs, fixed_length, engine_thread) -> Serving:
        """A `Serving` over a core of its own (`serving`)."""
        core, length = serving_engine(self, max_num_seqs or self.max_num_seqs, fixed_length, engine_thread)  # fmt: skip
        return Serving(core, self._requests, length, self.tokenizer.eos_token_id or 0)

    def _count_forward(self, compiled: bool) -> None:
        self._forwards += 1
        self._compiled_steps += compiled

    def _count_verified(self, drafts: int, guessed: int, kept: int) -> None:
        self._spec_verifies += 1
        self._spec_drafts += drafts
        self._spec_guessed += guessed
        self._spec_kept += kept

    def stream(
        self, prompt: str | Mapping[str, Any], sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """One prompt's output as it grows: each item is the whole `RequestOutput` so far,
        the last one `finished`. Streams from several threads are batched together;
        leaving the loop early cancels the request."""
        texts, ids, encoded = parse_prompts(prompt, lambda text: self.tokenizer(text).input_ids)
        if len(ids) != 1:
            raise ConfigError(f"stream takes one prompt, got {len(ids)}")
        check_token_ids(ids, vocab_limit(self.model), encoded)
        return self.serving().stream(texts[0], ids[0], sampling_params or SamplingParams())

    @serialized
    def transfer_stats(self) -> TransferStats:
        """Bytes moved so far, host to device and back (weights and KV cache, CUDA graph
        replays included), the time compute waited for weight copies, and the number of
        model forwards (prefill chunks and decode steps) that moved them."""
        weights = self.offloader.stats()
        now = TransferStats.of(weights)
        moved = self._generator.moved() if self._generator else TransferStats()
        if self._served is not None:
            moved += core_moved(self._served.core)
        return moved + replace(
            now,
            stall_s=weights.copies.stall_s,
            num_forwards=self._forwards,
            num_compiled_steps=self._compiled_steps,
            num_spec_verifies=self._spec_verifies,
            num_spec_drafts=self._spec_drafts,
            num_spec_draft_tokens=self._spec_guessed,
            num_spec_accepted_tokens=self._spec_kept,
            compile_s=self._cpu_step.compile_s if self._cpu_step is not None else 0.0,
        )

    def _generate(self, prompts, ids, sampling_params, use_tqdm=False) -> list[RequestOutput]:
        """Every request on an engine core run here (the caller holds the model): each
        prefills alone and decodes beside the others, as under serve."""
        if self._generator is None:
            self._generator = generator_of(self)
        params = per_prompt(sampling_params, len(prompts))
        try:
            return self._generator.run(prompts, ids, params, use_tqdm, self._on_step)
        except BaseException as error:
            if not isinstance(error, Exception):  # (Ctrl-C: its copies may be mid-way)
                self._generator.close()
            raise

    def wait_for_compiles(self, loads: bool = True) -> None:
        """Wait for CPU decode steps compiling in the background (decoding does not), so
        that the next process loads them instead of compiling them again. `loads` False:
        not for kept steps still loading (they keep nothing new)."""
        if self._cpu_step is not None:
            self._cpu_step.wait(loads=loads)

    def close(self) -> None:
        """End the copy threads and drop the model, its offloaded weights and the host KV
        cache (a call in progress in another thread finishes first). Later calls of
        `generate` or `chat` raise; closing twice is fine."""
        with self._serving_lock:
            served, self._served = self._served, None
        if served is not None:
            served.close()  # (its forwards take the lock below)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._cpu_step is not None:  # (before the teardown a compile may be tracing)
                self._cpu_step.close()
            if self._generator is not None:  # (its rows' KV cache)
                self._generator.close()
            self.offloader.close()
            if getattr(self, "_drafter", None) is not None:
                self._drafter.close()
            if getattr(self, "_pipeline", None) is not None:  # (the other ranks end)
                self._pipeline.close()
            del self.model, self.offloader, self._kv_pool
            del self._serving_kv_pool, self._more_kv_pools, self._lane_kv_pools
        trim_freed_memory()

    @contextlib.contextmanager
    def _streaming(self, on_step: Callable[[list[SequenceState]], None]) -> Iterator[None]:
        """Call `on_step(sequences)` after each token of the calls made inside (the
        `offload` command shows text as it is generated with it)."""
        self._on_step = on_step
        try:
            yield
        finally:
            self._on_step = None

    def get_tokenizer(self) -> Any:
        """The tokenizer that prompts and chats go through (vLLM's name)."""
        return self.tokenizer

    def set_tokenizer(self, tokenizer: Any) -> None:
        """Use `tokenizer` for later calls (vLLM's name); it must fit the model's vocabulary."""
        self.tokenizer = tokenizer
        damage, self._tokens = self._tokens.damage, TokenSteps(tokenizer, self._tokens.eos_ids)
        self._tokens.damage = damage  # (which tensor a non-finite logit came from)
        grammars = Grammars(tokenizer, self._requests.vocab_size, self._tokens.eos_ids)
        self._requests = replace(self._requests, encode=self._tokens.encode, grammars=grammars)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


__all__ = ["LLM", "CompletionOutput", "RequestOutput"]
