"""What the commands do where a flag is left out: the question asked, the offloading used."""

from __future__ import annotations

from torch import nn

from offload.config import OffloadConfig, UVAOffloadConfig
from offload.offloader.layers import find_layer_stacks
from offload.sizes import GIB, parameter_bytes


def whole_stack_config(model: nn.Module) -> OffloadConfig:
    """UVA offloading of every block of the model's layer stacks (what `generate` and
    `demo` do with no offload flags); nothing to offload when the model has no stack."""
    layer_bytes = sum(parameter_bytes(b) for _, blocks in find_layer_stacks(model) for b in blocks)
    return OffloadConfig(uva=UVAOffloadConfig(cpu_offload_gb=layer_bytes / GIB))
