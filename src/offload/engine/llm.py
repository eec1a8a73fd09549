"""`LLM`: vLLM's offline API (`generate`, `chat`) over an offloaded Hugging Face model."""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from offload.config import OFFLOAD_KEYS, OffloadConfig
from offload.engine.checks import (
    check_chat_args,
    check_llm_args,
    check_token_ids,
    check_use_tqdm,
    conversations_of,
    parse_prompts,
    render_chat,
    vocab_limit,
)
from offload.engine.fit import (
    check_host_kv,
    check_host_room,
    check_swap_space,
    device_budget,
    measure,
    plan_fit,
)
from offload.engine.graphs import DecodeGraphs, DecodeStep
from offload.engine.kv_cache import KV_SLOTS, KVHostPool, KVOffloader
from offload.engine.kv_shape import kv_shape_of
from offload.engine.sampling import (
    SamplingParams,
    TokenCounts,
    bad_words_token_ids,
    make_generator,
)
from offload.engine.sequences import (
    Batch,
    CompletionOutput,
    RequestOutput,
    RequestProgress,
    SequenceState,
    completion_of,
    per_prompt,
)
from offload.engine.tokens import TokenSteps
from offload.engine.transfer_stats import TransferStats
from offload.engine.transformers_cache import cache_argument, probe_kv_dims, static_cache
from offload.engine.vllm_args import IGNORED, check_ignored
from offload.errors import ConfigError, ModelError
from offload.memory.device import check_device
from offload.model.build import build_empty
from offload.model.configs import resolve as shipped
from offload.model.loader import load_model
from offload.model.sources import resolve_model
from offload.model.tokenizer import NoTokenizer, eos_token_ids, load_tokenizer
from offload.offloader.factory import as_config


def _serialized(method: Callable) -> Callable:
    """One call at a time per `LLM`: the offloaded weights' device slots, the KV cache and
    the counters belong to one forward at a time, so a second thread's call waits for
    the first to finish (each gets exactly the tokens it would get alone)."""

    @functools.wraps(method)
    def call(self: LLM, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if self._closed:
                raise ConfigError("this LLM is closed; make a new LLM(...) to generate again")
            return method(self, *args, **kwargs)

    return call


class LLM:
    """Load a model with offloading in place and generate text, as vLLM's `LLM` does.

    `model` is a Hugging Face model directory with safetensors weights (default: the
    bundled SmolLM2-135M-Instruct). Offloading is set by an `offload_config`
    (`OffloadConfig` or dict) or by vLLM's keyword names: `cpu_offload_gb`,
    `cpu_offload_params`, `offload_backend`, `offload_group_size`,
    `offload_num_in_group`, `offload_prefetch_step`, `offload_params`.

    The KV cache lives in host memory, layer by layer brought to the device ahead of
    use, with `kv_offload=True` or `swap_space` > 0 (GiB of host memory it may take;
    unlike vLLM's preemption swap space, which this engine has no use for, it holds the
    cache itself). `device_memory_gb` emulates a smaller device.

    One `LLM` may be shared by threads: their calls run one at a time, each with the
    output it would have alone. `close()` (or a `with LLM(...) as llm:` block) ends its
    copy threads and lets its memory go at once; otherwise that happens when the object
    is garbage-collected.

    As in vLLM, the checkpoint's own Python code (an `auto_map` in its config.json or
    tokenizer_config.json) runs only with `trust_remote_code=True`.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.9,
        device_memory_gb: float | None = None,
        swap_space: float = 0,
        kv_offload: bool = False,
        seed: int = 0,
        load_format: str = "auto",
        progress: bool | None = None,
        enforce_eager: bool = False,
        max_logprobs: int = 20,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        tokenizer: str | Path | None = None,
        tensor_parallel_size: int = 1,
        trust_remote_code: bool = False,
        offload_config: OffloadConfig | Mapping[str, Any] | None = None,
        **offload_flags: Any,
    ):
        self._lock = threading.Lock()
        self._closed = False
        self._on_step: Callable[[list[SequenceState]], None] | None = None  # see _streaming
        check_llm_args(
            model=model,
            tokenizer=tokenizer,
            dtype=dtype,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            device_memory_gb=device_memory_gb,
            swap_space=swap_space,
            seed=seed,
            load_format=load_format,
            kv_offload=kv_offload,
            enforce_eager=enforce_eager,
            progress=progress,
        )
        config = _offload_config(offload_config, offload_flags)
        if tensor_parallel_size != 1:
            raise ConfigError(
                f"tensor_parallel_size must be 1 (offload runs a model on one device), "
                f"got {tensor_parallel_size!r}"
            )
        self.max_logprobs = _whole("max_logprobs", max_logprobs, -1)  # -1: no limit, as vLLM
        self.max_num_seqs = _whole("max_num_seqs", max_num_seqs, 1)
        self.max_num_batched_tokens = (
            None
            if max_num_batched_tokens is None
            else _whole("max_num_batched_tokens", max_num_batched_tokens, 1)
        )
        if not isinstance(trust_remote_code, bool):
            raise ConfigError(f"trust_remote_code must be True or False, got {trust_remote_code!r}")
        self.trust_remote_code = trust_remote_code
        # Refused before anything is read or allocated.
        self.swap_space_bytes = check_swap_space(swap_space)
        self.kv_offload = bool(kv_offload) or self.swap_space_bytes > 0
        # A shipped shape's name (llama-3-8b, ...) with dummy weights, as `inspect` takes it.
        path = resolve_model(shipped(model) if load_format == "dummy" and model else model)
        self.device = check_device(device)
        empty = build_empty(path, dtype, trust_remote_code)
        if getattr(empty, "_is_stateful", False):
            raise ModelError(
                f"LLM runs attention models with a KV cache; {type(empty).__name__} keeps a "
                "recurrent state (offload.apply still offloads its layers for model.generate)"
            )
        limit = getattr(empty.config, "max_position_embeddings", None) or 2048
        if max_model_len is not None and not 0 < max_model_len <= limit:
            raise ConfigError(
                f"max_model_len must be in [1, {limit}] for this model, got {max_model_len}"
            )
        self.max_model_len = max_model_len or limit
        budget = device_budget(self.device, gpu_memory_utilization, device_memory_gb)
        self.memory_needs = measure(empty, self.max_model_len, self.max_num_batched_tokens)
        if self.kv_offload:  # the device holds only the slots: two layers' keys and values
            layers = empty.config.num_hidden_layers
            slots = min(KV_SLOTS, layers) * self.memory_needs.kv_cache // layers
            self.memory_needs = replace(self.memory_needs, kv_cache=slots)
        config, offloaded = plan_fit(
            empty, config, self.memory_needs, budget, self.device, self.kv_offload
        )
        check_host_room(self.swap_space_bytes, offloaded)
        # Before the weights: its errors come first.
        self.tokenizer = _tokenizer(path, tokenizer, load_format, trust_remote_code)
        self._tokens = TokenSteps(self.tokenizer, eos_token_ids(path, self.tokenizer, empty.config))
        if progress is None:  # a bar for the load when someone watches
            progress = sys.stderr.isatty()
        self.model, self.offloader = load_model(
            path,
            config,
            device=self.device,
            dtype=dtype,
            load_format=load_format,
            progress=progress,
            trust_remote_code=trust_remote_code,
        )
        self._moved = TransferStats()  # KV and graph-replay bytes, summed over calls
        self._forwards = 0  # model forwards (prefill chunks, decode steps), summed over calls
        # Host memory of the offloaded KV cache, kept between calls (pinned once).
        self._kv_dims: tuple | None = None  # (the probed dims,), measured on first use
        self._kv_pool = KVHostPool(self.device, disable_pin_memory=config.disable_pin_memory)
        # CUDA graphs for decode, as vLLM does unless enforce_eager; copies from unpinned
        # memory or per-forward weight copies cannot be captured.
        self._use_graphs = (
            self.device.type == "cuda"
            and not enforce_eager
            and not config.disable_pin_memory
            and not config.disable_uva
        )
        self.seed = seed
        torch.manual_seed(seed)

    # -- public API -------------------------------------------------------------

    @_serialized
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

    @_serialized
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
        conversations = conversations_of(messages)
        check_chat_args(
            chat_template,
            add_generation_prompt,
            continue_final_message,
            tools,
            chat_template_kwargs,
        )
        check_use_tqdm(use_tqdm)
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(
                "this model's tokenizer has no chat template; pass chat_template= or use "
                "generate() with a plain prompt"
            )
        if add_generation_prompt and continue_final_message:
            raise ConfigError(
                "continue_final_message=True needs add_generation_prompt=False: the reply "
                "either continues the last message or starts a new one"
            )
        texts = render_chat(
            self.tokenizer,
            conversations,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            **(chat_template_kwargs or {}),
        )
        ids = [self.tokenizer(t, add_special_tokens=False).input_ids for t in texts]
        check_token_ids(ids, vocab_limit(self.model), [True] * len(ids))
        return self._generate(texts, ids, sampling_params, use_tqdm)

    def close(self) -> None:
        """End the copy threads and drop the model, its offloaded weights and the host KV
        cache (a call in progress in another thread finishes first). Later calls of
        `generate` or `chat` raise; closing twice is fine."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.offloader.close()
            del self.model, self.offloader, self._kv_pool

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
        self._tokens = TokenSteps(tokenizer, self._tokens.eos_ids)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the decode loop ----------------------------------------------------------

    def _generate(self, prompts, ids, sampling_params, use_tqdm=False) -> list[RequestOutput]:
        params = per_prompt(sampling_params, len(prompts))
        ids = [self._truncate(i, p) for i, p in zip(ids, params, strict=True)]
        for prompt_ids, request in zip(ids, params, strict=True):  # all before any work
            self._check_request(prompt_ids, request)
        vocab = self.model.config.vocab_size
        sequences = []
        for index, (prompt_ids, request) in enumerate(zip(ids, params, strict=True)):
            generator = make_generator(request, self.device)
            room = self.max_model_len - len(prompt_ids)
            limit = room if request.max_tokens is None else min(request.max_tokens, room)
            bad_ids = bad_words_token_ids(request.bad_words or [], self._tokens.encode)
            for number in range(request.n):
                counts = (
                    TokenCounts(prompt_ids, vocab, self.device) if request.has_penalties else None
                )
                sequence = SequenceState(prompt_ids, request, generator, limit, counts)
                sequence.is_first, sequence.request, sequence.bad_ids = number == 0, index, bad_ids
                sequences.append(sequence)
        if sequences:
            progress = RequestProgress(sequences, use_tqdm)
            try:  # at most max_num_seqs sequences in one batch, as vLLM schedules them
                for start in range(0, len(sequences), self.max_num_seqs):
                    self._decode(sequences[start : start + self.max_num_seqs], progress)
            finally:
                progress.close()
        outputs, start = [], 0
        for number, (prompt, prompt_ids, request) in enumerate(
            zip(prompts, ids, params, strict=True)
        ):
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

    def _truncate(self, prompt_ids: list[int], request: SamplingParams) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` tokens (-1: room for one new token)."""
        keep = request.truncate_prompt_tokens
        if keep is None:
            return prompt_ids
        return prompt_ids[-(self.max_model_len - 1 if keep == -1 else keep) :]

    def _check_request(self, prompt_ids: list[int], request: SamplingParams) -> None:
        if not prompt_ids or len(prompt_ids) >= self.max_model_len:
            raise ConfigError(
                f"a prompt has {len(prompt_ids)} tokens; it must have 1 to "
                f"{self.max_model_len - 1} (max_model_len={self.max_model_len})"
            )
        vocab = self.model.config.vocab_size
        for name, tokens in request.token_ids_named().items():
            if any(token >= vocab for token in tokens):
                raise ConfigError(
                    f"{name} must hold token ids below the vocabulary size {vocab}, "
                    f"got {max(tokens)}"
                )
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(request, name)
            num = vocab if asked == -1 else asked
            if num is not None and self.max_logprobs != -1 and num > self.max_logprobs:
                raise ConfigError(
                    f"{name}={asked} asks for {num} log-probabilities per token; at most "
                    f"max_logprobs={self.max_logprobs} are allowed (set LLM(max_logprobs=...))"
                )

    @torch.inference_mode()
    def _decode(self, sequences: list[SequenceState], progress: RequestProgress) -> None:
        """All sequences as one left-padded batch in a static KV cache (fixed shapes, the
        shape CUDA-graph decode needs): a prefill, then one token per step."""
        batch = Batch.of(sequences, self.tokenizer.pad_token_id, self.device)
        cache = self._make_cache(len(sequences), batch.length)
        graphs = None
        try:
            graphs = self._decode_steps(sequences, batch, cache, progress)
        finally:
            self._count_moved(cache.kv_offloader, graphs)
        for sequence in sequences:
            if sequence.finish_reason is None:
                sequence.finish_reason = "length"

    def _count_moved(self, kv: KVOffloader | None, graphs: DecodeGraphs | None) -> None:
        """Add what this call moved to the running totals (graph replays included)."""
        if kv is not None:
            kv.close()
            self._moved += TransferStats.of_counters(kv=kv.stats())
        if graphs is not None:
            self._moved += graphs.replayed

    @_serialized
    def transfer_stats(self) -> TransferStats:
        """Bytes moved so far, host to device and back (weights and KV cache, CUDA graph
        replays included), the time compute waited for weight copies, and the number of
        model forwards (prefill chunks and decode steps) that moved them."""
        weights = self.offloader.stats()
        now = TransferStats.of_counters(weights)
        return self._moved + replace(
            now, stall_s=weights.get("stall_s", 0.0), num_forwards=self._forwards
        )

    def _make_cache(self, batch: int, length: int):
        dtype = next(self.model.parameters()).dtype
        dims = None
        if self.kv_offload:
            if self._kv_dims is None:  # once: what the attention layers really cache
                self._kv_dims = (probe_kv_dims(self.model),)
                self._forwards += 1  # the probe is a forward of the whole model too
            (dims,) = self._kv_dims
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
            host_pool=self._kv_pool,
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

    def _decode_steps(
        self, sequences: list[SequenceState], batch: Batch, cache, progress: RequestProgress
    ) -> DecodeGraphs | None:
        """The prefill, then one token per step: the first decode step eagerly (it also
        warms up), the rest as CUDA graph replays on a GPU unless `enforce_eager`."""
        positions = (batch.columns[None, : batch.width] - batch.starts[:, None]).clamp(min=0)
        every_position = any(s.params.prompt_logprobs is not None for s in sequences)
        logits = self._prefill(batch, positions, cache, every_position)  # [batch, cols, vocab]
        if every_position:
            self._tokens.prompt_logprobs(logits, sequences, batch.width)
        logits = logits[:, -1, :]  # [batch, vocab]
        step = DecodeStep(self.model, cache, batch.mask, positions)
        graphs, position = None, batch.width  # where the newest token goes
        while True:
            tokens = self._tokens.pick(logits, sequences)
            progress.update()
            if self._on_step is not None:
                self._on_step(sequences)
            # The text so far is position + 1 long.
            if all(s.finish_reason is not None for s in sequences) or position + 1 >= batch.length:
                return graphs
            step.prepare(tokens, position)
            if graphs is None and self._use_graphs and position > batch.width:
                graphs = DecodeGraphs(step, self.offloader, cache.kv_offloader)
            logits = graphs.run(position + 1) if graphs is not None else step()
            self._forwards += 1
            position += 1


def _tokenizer(path: Path, tokenizer, load_format: str, trust_remote_code: bool):
    """The tokenizer; a dummy model from a bare config.json (a shipped shape) has none."""
    folder = Path(tokenizer) if tokenizer is not None else path
    bare = not any(
        (folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
    )
    if load_format == "dummy" and tokenizer is None and bare:
        return NoTokenizer()
    return load_tokenizer(folder, trust_remote_code)


def _offload_config(
    offload_config: OffloadConfig | Mapping[str, Any] | None, flags: dict[str, Any]
) -> OffloadConfig:
    ignored = {key: flags.pop(key) for key in list(flags) if key in IGNORED}
    unknown = [key for key in flags if key not in OFFLOAD_KEYS]
    if unknown:
        own = [
            n
            for n in inspect.signature(LLM.__init__).parameters
            if n not in ("self", "offload_flags")
        ]
        raise ConfigError(
            f"LLM() got an unexpected argument {unknown[0]!r}; it takes {', '.join(own)}; "
            f"the offload flags {', '.join(OFFLOAD_KEYS)}; and, at values that change "
            f"nothing here, vLLM's {', '.join(IGNORED)}"
        )
    check_ignored(ignored)
    if offload_config is not None and flags:
        raise ConfigError("pass offload settings either as offload_config or as flags, not both")
    return as_config(offload_config if offload_config is not None else flags)


def _whole(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


__all__ = ["LLM", "CompletionOutput", "RequestOutput"]
