"""The model and the `LLM` of a command (`generate`, `inspect`, `serve`): its model
resolved once (a `ModelSpec`), then handed to the `LLM` with the command's flags."""

from __future__ import annotations

import argparse
from typing import Any

from offload.config import OffloadConfig
from offload.llm.engine_args import EngineArgs
from offload.llm.llm import LLM
from offload.llm.spec import ModelSpec, model_spec


def llm_of(args: argparse.Namespace, model, config: OffloadConfig, **more) -> LLM:
    """The `LLM` of a command's model (a `ModelSpec`, or a folder), device, budget and
    offload flags (and `more`)."""
    return LLM(model, **llm_arguments(args, config, **more))


def llm_arguments(args: argparse.Namespace, config: OffloadConfig, **more) -> dict[str, Any]:
    """`LLM`'s keyword arguments from a command's flags (and `more`), checked as one
    record (`EngineArgs`): called before the model is read, a bad flag costs nothing."""
    arguments = dict(
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        speculative_config=getattr(args, "speculative_config", None),
        pipeline_parallel_size=getattr(args, "pipeline_parallel_size", 1),
        pipeline_micro_batches=getattr(args, "pipeline_micro_batches", None),
        gpu_memory_utilization=args.gpu_memory_utilization,
        device_memory_gb=args.device_memory_gb,
        trust_remote_code=args.trust_remote_code,
        offload_config=config,
        quantization=args.quantization,
        **more,
    )
    EngineArgs(**arguments)
    return arguments


def spec_of(
    args: argparse.Namespace, model: str | None, config: OffloadConfig, shapes: bool = False
) -> ModelSpec:
    """A command's model, resolved once (a .gguf as stored, on the layout of the device it
    will run on, unless --dtype asks for a float conversion) and built on meta; `shapes`:
    a shipped shape's name (llama-3-8b) names its config."""
    return model_spec(
        model,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        quantization_name="--quantization",
        offload_folder=config.disk.offload_folder,
        disk=config.disk,
        trust_remote_code=args.trust_remote_code,
        shapes=shapes,
    )
