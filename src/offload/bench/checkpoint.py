"""A sharded safetensors checkpoint of random weights for a model shape (a config.json
with no weights): what `offload bench` and the benchmarks run when no real checkpoint is
at hand, so that every method reads real files (the disk tier and accelerate's offload
folder need them)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def write_random_checkpoint(
    folder: Path, config: dict[str, object], max_shard_bytes: int, seed: int = 0
) -> list[Path]:
    """A sharded safetensors checkpoint of random weights for the Hugging Face `config`
    (a config.json as a dict), written one shard at a time: tensors in the model's own
    order fill a shard up to `max_shard_bytes` (transformers' `max_shard_size` rule), so
    layers span files and at most one shard is ever in memory. Written into a staging
    folder renamed into place; an existing complete folder is reused. Returns the shards."""
    import shutil
    import tempfile

    from safetensors.torch import save_file

    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        return [folder / name for name in sorted(set(_weight_map(index_path).values()))]
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        specs = _parameter_specs(config)
        shards = _shard_by_size(specs, max_shard_bytes)
        generator = torch.Generator().manual_seed(seed)
        weight_map: dict[str, str] = {}
        for number, names in enumerate(shards, start=1):
            name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            tensors = {key: _random_tensor(key, *specs[key], generator) for key in names}
            save_file(tensors, staging / name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(names, name))
            del tensors
        total = sum(_numel(shape) * dtype.itemsize for shape, dtype in specs.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [folder / name for name in sorted(set(weight_map.values()))]


def _weight_map(index_path: Path) -> dict[str, str]:
    return json.loads(index_path.read_text())["weight_map"]


def _parameter_specs(config: dict[str, object]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every weight the checkpoint holds, in the model's order,
    from a model built on the meta device (nothing allocated)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**config)
    dtype = getattr(torch, str(config.get("dtype", "float32")))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}


def _shard_by_size(
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]], max_shard_bytes: int
) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for name, (shape, dtype) in specs.items():
        num_bytes = _numel(shape) * dtype.itemsize
        if shards[-1] and shard_bytes + num_bytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += num_bytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _random_tensor(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator
) -> torch.Tensor:
    """Norm weights 1, others N(0, 0.02) like Hugging Face's init: activations stay finite."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    return (torch.randn(shape, generator=generator) * 0.02).to(dtype)
