"""`ModelSpec`: the model a command or an `LLM` runs, resolved once: its local folder (a
.gguf or .bin converted, a hub id found in the cache), the device it runs on, the dtype
and quantization it is read in, and the model built on the meta device from its
config.json. `make_model_spec` is the one preamble every entry point runs (`LLM`, `offload
generate`, `inspect`, `serve`, `plan` and `bench`); `offload.llm.spec.model_spec` gives it
this machine's layout chooser."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from offload.config.parts import DiskOffloadConfig
from offload.memory.device import check_device
from offload.memory.placement import AUTO
from offload.model.build import build_empty
from offload.model.configs import resolve as shipped
from offload.model.sources import resolve_model, stored_unless_asked
from offload.quant.choice import LayoutChoosers
from offload.quant.quantized import check_quantization


@dataclass(frozen=True)
class ModelSpec:
    """A model resolved and built on the meta device. `quantization` is the form it runs
    in (a .gguf as stored unless a dtype was asked: `stored_unless_asked`). An `LLM` made
    from a spec loads its `empty` model in place: one spec makes one `LLM`."""

    path: Path
    device: torch.device
    dtype: str | torch.dtype
    quantization: str | None
    empty: nn.Module
    trust_remote_code: bool = False


def make_model_spec(
    model: str | Path | None,
    *,
    device: str | torch.device = AUTO,
    dtype: str | torch.dtype = AUTO,
    quantization: str | None = None,
    quantization_name: str = "LLM(): quantization",
    offload_folder: str | Path | None = None,
    trust_remote_code: bool = False,
    shapes: bool = False,
    as_stored: bool = True,
    layout_chooser: LayoutChoosers | None = None,
    disk: DiskOffloadConfig | None = None,
) -> ModelSpec:
    """Check the device, then the quantization (`quantization_name` says where it was
    given), choose the form a .gguf runs in (`as_stored`: as stored unless a dtype is
    asked), resolve `model` to its folder (`shapes`: a shipped shape's name, such as
    "llama-3-8b", names its config; conversions go into `offload_folder`) and build it on
    the meta device. `disk`: the disk tier it will run with (a checkpoint it would map gets
    a copy with its matrices aligned, `sources.py`)."""
    checked = check_device(device)
    quantization = check_quantization(quantization, quantization_name)
    if shapes and model:
        model = shipped(model)
    if as_stored:
        quantization = stored_unless_asked(model, quantization, dtype, checked)
    path = resolve_model(
        model,
        offload_folder,
        quantization=quantization,
        device=checked,
        layout_chooser=layout_chooser,
        mapped=disk if disk is not None and disk.is_active and checked.type == "cpu" else None,
    )
    empty = build_empty(path, dtype, trust_remote_code)
    return ModelSpec(path, checked, dtype, quantization, empty, trust_remote_code)
