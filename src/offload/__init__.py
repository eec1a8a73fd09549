"""offload: run PyTorch models larger than the GPU by keeping weights in host memory.

Configs, flags and the offloader API follow vLLM's (`OffloadConfig`, `UVAOffloader`,
`create_offloader`, `get_offloader`, `set_offloader`); `apply` offloads any built model;
`LLM(...).generate(prompts, SamplingParams(...))` loads a checkpoint with offloading in place.
"""

import importlib
import os
from typing import TYPE_CHECKING

# MKL's products in ATen's CPU attention (a decode step's) round a sequence's sums by where
# its thread's buffer lies on some CPUs (measured: an AMD EPYC, 2 threads), so a row's bits
# then depend on its batch; its conditional reproducibility removes that. Read at MKL's
# first call: set here, before this package runs one (`engine/step_order.mkl_reproducible`
# checks it took effect). A user's own setting wins.
os.environ.setdefault("MKL_CBWR", "AUTO")

# Where each public name lives: imported on first use (PEP 562), so that `offload --help`
# and the command's one-line errors start without torch (seconds on a small machine).
_HOMES = {
    "apply": "offload.api",
    "OffloadConfig": "offload.config",
    "PrefetchOffloadConfig": "offload.config",
    "UVAOffloadConfig": "offload.config",
    "Logprob": "offload.engine.logprobs",
    "SamplingParams": "offload.engine.sampling_params",
    "StructuredOutputsParams": "offload.engine.structured",
    "GuidedDecodingParams": "offload.engine.structured",
    "ConfigError": "offload.errors",
    "ModelError": "offload.errors",
    "OffloadError": "offload.errors",
    "LLM": "offload.llm",
    "CompletionOutput": "offload.llm",
    "RequestOutput": "offload.llm",
    "BaseOffloader": "offload.offloader",
    "NoopOffloader": "offload.offloader",
    "OffloadedParam": "offload.offloader",
    "PrefetchOffloader": "offload.offloader",
    "UVAOffloader": "offload.offloader",
    "create_offloader": "offload.offloader",
    "get_offloader": "offload.offloader",
    "set_offloader": "offload.offloader",
}

if TYPE_CHECKING:
    from offload.api import apply
    from offload.config import OffloadConfig, PrefetchOffloadConfig, UVAOffloadConfig
    from offload.engine.logprobs import Logprob
    from offload.engine.sampling_params import SamplingParams
    from offload.engine.structured import GuidedDecodingParams, StructuredOutputsParams
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


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'offload' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # (once: later lookups do not come here)
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])


__all__ = [
    "LLM",
    "BaseOffloader",
    "CompletionOutput",
    "ConfigError",
    "GuidedDecodingParams",
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
    "StructuredOutputsParams",
    "UVAOffloadConfig",
    "UVAOffloader",
    "apply",
    "create_offloader",
    "get_offloader",
    "set_offloader",
]
