"""A folder of `pytorch_model*.bin` weights converted into safetensors, one shard at a
time (the pickles are read with `weights_only`: code in them is refused, none of it runs).
`sources.py` runs it once per version of the folder."""

from __future__ import annotations

import shutil
from pathlib import Path

from offload.errors import ModelError


def from_bin(folder: Path, bins: list[Path], out: Path) -> None:
    """One safetensors file per .bin shard (peak memory: one shard), plus the index."""
    import torch
    from safetensors.torch import save_file

    index: dict[str, str] = {}
    for number, source in enumerate(bins, 1):
        state = load_tensors(source)
        tensors, seen = {}, {}
        for name, tensor in state.items():
            if not isinstance(tensor, torch.Tensor):
                continue
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape)
            if key in seen:  # a tied weight saved twice: safetensors stores it once
                continue
            seen[key] = name
            tensors[name] = tensor.contiguous()
        shard = f"model-{number:05d}-of-{len(bins):05d}.safetensors"
        save_file(_unshared(tensors), out / shard, metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, shard))
        del state, tensors
    import json

    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": index}, indent=1)
    )
    for extra in folder.iterdir():
        if (
            extra.is_file()
            and extra.suffix != ".bin"
            and not extra.name.endswith(".bin.index.json")
        ):
            shutil.copy2(extra, out / extra.name)


def load_tensors(source: Path) -> dict:
    """A .bin shard's tensors; a pickle that holds anything else (code a loader would
    run) is refused, and none of it runs."""
    import pickle

    import torch

    try:
        state = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        raise ModelError(
            f"{source} holds code, not only tensors: refused (none of it ran); convert it "
            "to safetensors with a tool you trust"
        ) from None
    if not isinstance(state, dict):
        raise ModelError(f"{source} is not a state dict of tensors (a {type(state).__name__})")
    return state


def _unshared(tensors: dict) -> dict:
    """Tensors that share storage (views of one buffer) get their own copies."""
    pointers: dict[int, int] = {}
    result = {}
    for name, tensor in tensors.items():
        pointer = tensor.untyped_storage().data_ptr()
        pointers[pointer] = pointers.get(pointer, 0) + 1
        result[name] = tensor
    return {
        name: (t.clone() if pointers[t.untyped_storage().data_ptr()] > 1 else t)
        for name, t in result.items()
    }
