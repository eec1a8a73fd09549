"""Load a Hugging Face causal LM with its offloading in place: build it without allocating
its weights (`build.py`), match the checkpoint to it (`checkpoint.py`), then stream each
tensor from the checkpoint straight into where the offload plan puts it.

Offloaded tensors are read from the file directly into their layer's host slab; resident
ones go through one reusable host staging buffer to the device. The model is never
whole in host memory, nor on the device.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offload.api import OffloadPlan, finish, prepare
from offload.config import OffloadConfig
from offload.errors import ModelError
from offload.memory.disk_layout import TensorRange
from offload.memory.host import HostSlab, TensorSpec, should_pin_memory
from offload.memory.placement import AUTO, DiskIO
from offload.memory.safetensors import StoredTensor, checkpoint_tensors, read_into
from offload.model.build import build_empty
from offload.model.checkpoint import checkpoint_targets
from offload.model.configs import resolve
from offload.model.merges import Assembled
from offload.offloader.base import BaseOffloader
from offload.offloader.disk_tier import ReadHooks

LOAD_FORMATS = (AUTO, "safetensors", "dummy")
_DUMMY_PIECE_VALUES = 2**22  # float32 values drawn at a time for a dummy weight (16 MiB)


def load_model(
    path: str | Path,
    config: OffloadConfig | Mapping[str, Any] | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = AUTO,
    load_format: str = AUTO,
    progress: bool = False,
    trust_remote_code: bool = False,
    read_hooks: ReadHooks | None = None,
    stack_budget_bytes: int | None = None,
    planned: OffloadPlan | None = None,
    model: nn.Module | None = None,
) -> tuple[nn.Module, BaseOffloader]:
    """Load a causal LM from a safetensors directory with `config`'s offloading already in
    place. `load_format="dummy"` (vLLM's name) fills random weights of the right shapes
    instead, for benchmarks of large shapes without a checkpoint (only `config.json` is read;
    `path` may also name a shipped config, e.g. "llama-3-8b": see `offload.model.configs`).
    The checkpoint's own code runs only with `trust_remote_code=True` (see `build_empty`).
    `read_hooks`: the disk tier's switches for tests. `stack_budget_bytes`: all the RAM
    a disk tier's layer stack may take (`LLM`'s process budget on a CPU; see `prepare`).
    `planned`: a dry run (`offload.api.plan`) of this checkpoint's model built on the meta
    device (`build_empty`, with these settings): that model is loaded, wrapped by the plan's
    offloader (no other is built; what makes one, `read_hooks` and `stack_budget_bytes`
    included, was the plan's). `model`: the model to load where there is no plan (built
    on the meta device from this checkpoint: a pipeline stage's, `distributed.cut`)."""
    if load_format not in LOAD_FORMATS:
        raise ModelError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}"
        )
    path = resolve(path) if load_format == "dummy" else Path(path)
    device = torch.device(device)
    if planned is not None:
        model = planned.model
    elif model is None:
        model = build_empty(path, dtype, trust_remote_code)
    stored = {} if load_format == "dummy" else checkpoint_tensors(path)
    targets = checkpoint_targets(model, stored, dummy=load_format == "dummy")
    ranges = {  # where each parameter's bytes are, for a disk tier to stream them
        name: TensorRange(entry.path, entry.offset, entry.num_bytes, entry.dtype)
        for name, entry in targets.items()
        if isinstance(entry, StoredTensor)
    }
    if planned is None:
        offloader = prepare(
            model,
            config,
            device,
            deferred=True,
            checkpoint=ranges,
            read_hooks=read_hooks,
            stack_budget_bytes=stack_budget_bytes,
        )
    else:  # the offloader the plan made, no second one (its disk tier had its ranges)
        offloader = prepare(
            model,
            config,
            device,
            deferred=True,
            read_hooks=read_hooks,
            stack_budget_bytes=stack_budget_bytes,
            planned=planned,
        )
    # With a disk tier around the page cache, loading leaves nothing there either: the
    # bytes read are in their final memory, and the budget holds for the machine.
    _fill(model, offloader, targets, device, progress, offloader.disk_io == DiskIO.DIRECT)
    return model, finish(offloader)


def _fill(model, offloader, targets, device: torch.device, progress: bool, drop: bool) -> None:
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    largest = max((_largest_read(e) for e in targets.values() if e is not None), default=0)
    staging = _Staging(largest, device, drop)
    generator = torch.Generator().manual_seed(0)
    dummy = any(entry is None for entry in targets.values())
    scratch = torch.empty(_DUMMY_PIECE_VALUES if dummy else 0, dtype=torch.float32)
    bar = None
    if progress:
        from tqdm import tqdm

        total = sum(e.num_bytes for e in targets.values() if e is not None)
        bar = tqdm(
            total=total, desc="Loading weights", unit="B", unit_scale=True, unit_divisor=1024
        )
    for name, entry in targets.items():
        if bar is not None and entry is not None:
            bar.update(entry.num_bytes)
        tensor = tensors[name]
        if offloader.ledger.on_disk(tensor):  # read from the checkpoint each time it runs
            continue
        host = offloader.ledger.host_view(tensor)
        destination = host if host is not None else tensor.data
        if entry is None:
            _dummy(destination, generator, scratch)
        elif isinstance(entry, Assembled):
            for part, index in entry.parts:  # each part straight into its slice
                _read(part, destination[index], staging)
        else:
            _read(entry, destination, staging)
    if bar is not None:
        bar.close()


def _read(entry: StoredTensor, destination: torch.Tensor, staging: _Staging) -> None:
    if (
        destination.device.type == "cpu"
        and destination.dtype == entry.dtype
        and destination.is_contiguous()
    ):
        read_into(entry, destination, staging.drop)  # file -> final memory, nothing between
    else:
        destination.copy_(staging.read(entry))  # file -> staging -> device, casting if needed


def _largest_read(entry: StoredTensor | Assembled) -> int:
    return entry.largest_part_bytes if isinstance(entry, Assembled) else entry.num_bytes


class _Staging:
    """One reusable host buffer (pinned when a GPU reads it) for tensors that do not go
    straight from the file to their final host memory; `drop`: every read leaves the page
    cache as it was."""

    def __init__(self, num_bytes: int, device: torch.device, drop: bool = False):
        self.drop = drop
        pin = should_pin_memory(device)
        self._slab = HostSlab(
            [TensorSpec((num_bytes,), torch.uint8)], pin_for=device if pin else None
        )

    def read(self, entry: StoredTensor) -> torch.Tensor:
        raw = self._slab.buffer[: entry.num_bytes]
        read_into(entry, raw, self.drop)
        return raw.view(entry.dtype).view(entry.shape)


def _dummy(destination: torch.Tensor, generator: torch.Generator, scratch: torch.Tensor) -> None:
    """Random weights of a plausible scale: ones for vectors (norms), N(0, 0.02) else,
    drawn through `scratch` (float32, `_DUMMY_PIECE_VALUES` long, reused)."""
    if destination.dim() <= 1:
        destination.fill_(1.0)
        return
    # Drawn a few rows at a time: a whole float32 copy of a large embedding would take
    # twice a bf16 model's own bytes beside it, past the budget of a plan's cut models.
    row_values = max(1, destination[0].numel())
    step = max(1, len(scratch) // row_values)
    if step * row_values > len(scratch):  # a row longer than the scratch: a whole copy
        scratch = torch.empty(destination.numel(), dtype=torch.float32)
        step = destination.shape[0]
    for start in range(0, destination.shape[0], step):
        piece = destination[start : start + step]
        values = scratch[: piece.numel()].view(piece.shape)
        piece.copy_(values.normal_(0.0, 0.02, generator=generator))
