"""offload: run PyTorch models larger than the GPU by keeping weights in host memory.

Configs, flags and the offloader API follow vLLM's (`OffloadConfig`, `UVAOffloader`,
`create_offloader`, `get_offloader`, `set_offloader`); `apply` offloads any built model;
`LLM(...).generate(prompts, SamplingParams(...))` loads a checkpoint with offloading in place.
"""

from offload.api import apply
from offload.config import OffloadConfig, PrefetchOffloadConfig, UVAOffloadConfig
from offload.engine.logprobs import Logprob
from offload.engine.sampling_params import SamplingParams
from offload.errors import ConfigError, ModelError, OffloadError
from offload.llm import LLM, CompletionOutput, RequestOutput
from offload.offloader import (
    BaseOffloader,
    NoopOffloader,
    OffloadedParam,
    PrefetchOffloader,
    UVAOffloader,
    create_offloader,
    get_offloader,
    set_offloader,
)

__all__ = [
    "LLM",
    "BaseOffloader",
    "CompletionOutput",
    "ConfigError",
    "Logprob",
    "ModelError",
    "NoopOffloader",
    "OffloadConfig",
    "OffloadError",
    "OffloadedParam",
    "PrefetchOffloadConfig",
    "PrefetchOffloader",
    "RequestOutput",
    "SamplingParams",
    "UVAOffloadConfig",
    "UVAOffloader",
    "apply",
    "create_offloader",
    "get_offloader",
    "set_offloader",
]
