"""`EngineArgs`: what `LLM(...)` is given, as one typed record (vLLM's name) that checks
itself when made, before anything is read or allocated: a bad argument is one line
naming it (`llm/checks.py`), an unknown one gets the nearest name (`llm/args.py`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from offload.config import OffloadConfig
from offload.config.limits import GPU_MEMORY_UTILIZATION
from offload.engine.speculative import SpeculativeConfig
from offload.errors import ConfigError
from offload.llm.args import offload_config_of
from offload.llm.checks import (
    EngineLimits,
    batch_invariant_of,
    check_llm_args,
    prefix_caching_of,
)
from offload.llm.spec import ModelSpec, model_spec
from offload.memory.placement import AUTO


@dataclass(frozen=True, kw_only=True)
class EngineArgs:
    """`LLM`'s arguments (the same names, defaults and order), checked in
    `__post_init__`; `limits`, `config` and `is_batch_invariant` are what they give.
    `model` may be a `ModelSpec` made beforehand (then it is not resolved again), and
    `offload_flags` are vLLM's offload flag names (not with `offload_config`)."""

    model: str | Path | ModelSpec | None = None
    dtype: str | torch.dtype = AUTO
    quantization: str | None = None
    device: str | torch.device = AUTO
    max_model_len: int | None = None
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    device_memory_gb: float | None = None
    swap_space: float = 0
    kv_cache_memory_bytes: int | None = None
    kv_offload: bool = False
    seed: int = 0
    load_format: str = AUTO
    progress: bool | None = None
    enforce_eager: bool = False
    max_logprobs: int = 20
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    batch_invariant: bool | None = None
    enable_prefix_caching: bool | None = None
    speculative_config: Mapping[str, Any] | str | SpeculativeConfig | None = None
    tokenizer: str | Path | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pipeline_micro_batches: int | None = None
    trust_remote_code: bool = False
    offload_config: OffloadConfig | Mapping[str, Any] | None = None
    offload_flags: Mapping[str, Any] = field(default_factory=dict)
    # What the arguments give, once checked:
    limits: EngineLimits = field(init=False)
    config: OffloadConfig = field(init=False)  # the offload settings
    is_batch_invariant: bool = field(init=False)  # (VLLM_BATCH_INVARIANT where None)
    prefix_caching: bool = field(init=False)  # (on where None, unless batch-invariant)
    speculative: SpeculativeConfig | None = field(init=False)  # (`speculative_config`)

    def __post_init__(self) -> None:
        limits = check_llm_args(
            model=None if isinstance(self.model, ModelSpec) else self.model,
            **{name: getattr(self, name) for name in _CHECKED},
        )
        flags = dict(self.offload_flags)
        config = offload_config_of(self.offload_config, flags, argument_names())
        # Each sequence's numbers whatever its batch (`engine/invariant.py`).
        invariant = batch_invariant_of(self.batch_invariant, limits.kv_offload)
        object.__setattr__(self, "limits", limits)
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "is_batch_invariant", invariant)
        caching = prefix_caching_of(self.enable_prefix_caching, invariant)
        object.__setattr__(self, "prefix_caching", caching)
        speculative = SpeculativeConfig.of(self.speculative_config)
        if speculative is not None and invariant:
            raise ConfigError(
                "speculative_config with batch_invariant: a verify forward scores a row's "
                "guesses together, which is not measured as batch invariant yet"
            )
        object.__setattr__(self, "speculative", speculative)

    def model_spec(self) -> ModelSpec:
        """The model these arguments name, resolved (a `ModelSpec` given is used as it
        is); a shipped shape's name (llama-3-8b, ...) with dummy weights, as `inspect`
        takes it."""
        if isinstance(self.model, ModelSpec):
            return self.model
        return model_spec(
            self.model,
            device=self.device,
            dtype=self.dtype,
            quantization=self.quantization,
            offload_folder=self.config.disk.offload_folder,
            disk=self.config.disk,
            trust_remote_code=self.trust_remote_code,
            shapes=self.load_format == "dummy",
        )


# The arguments `check_llm_args` checks by type and range (`model` apart: it may be a spec).
_CHECKED = (
    "tokenizer",
    "dtype",
    "max_model_len",
    "gpu_memory_utilization",
    "device_memory_gb",
    "seed",
    "load_format",
    "kv_offload",
    "enforce_eager",
    "progress",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "pipeline_micro_batches",
    "max_logprobs",
    "max_num_seqs",
    "max_num_batched_tokens",
    "trust_remote_code",
    "swap_space",
    "kv_cache_memory_bytes",
)


def argument_names() -> list[str]:
    """`LLM`'s own keyword arguments, named when an unknown one is refused."""
    return [f.name for f in fields(EngineArgs) if f.init and f.name != "offload_flags"]
