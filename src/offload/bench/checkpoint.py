"""A sharded safetensors checkpoint of random weights for a model shape (a config.json
with no weights): what `offload bench` and the benchmarks run when no real checkpoint is
at hand, so that every method reads real files (the disk tier and accelerate's offload
folder need them)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from offload.quant.gguf_quants import FORMATS
from offload.quant.kinds import QuantLayout
from offload.quant.layouts import layout_for
from offload.quant.traits import laid_out, stored_settings


def write_random_checkpoint(
    folder: Path,
    config: dict[str, object],
    max_shard_bytes: int,
    seed: int = 0,
    quantized: str | None = None,
    kernels: str = "gguf",
) -> list[Path]:
    """A sharded safetensors checkpoint of random weights for the Hugging Face `config`
    (a config.json as a dict), written one shard at a time: tensors in the model's own
    order fill a shard up to `max_shard_bytes` (transformers' `max_shard_size` rule), so
    layers span files and at most one shard is ever in memory. Written into a staging
    folder renamed into place; an existing complete folder is reused. Returns the shards.
    `quantized="Q4_0"` (or another GGUF type of `gguf_quants.FORMATS`): every matrix
    (embedding, projections, head) whose rows are whole blocks is kept as random blocks of
    that type, as offload keeps a .gguf read as stored (Q4_0: 4.5 bits a weight), laid out
    for `kernels` as a .gguf converted for them would be (`quant/layouts.py`); the rest in
    the config's dtype."""
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
        types = _quantized_types(specs, quantized)
        specs.update(
            {name: (_blocks_shape(specs[name][0], quantized), torch.uint8) for name in types}
        )
        shards = _shard_by_size(specs, max_shard_bytes)
        generator = torch.Generator().manual_seed(seed)
        weight_map: dict[str, str] = {}
        layouts: dict[str, str] = {}
        total = 0
        for number, names in enumerate(shards, start=1):
            name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            tensors: dict[str, torch.Tensor] = {}
            for key in names:
                if key not in types:
                    tensors[key] = _random_tensor(key, *specs[key], generator)
                    continue
                raw = random_blocks(types[key], specs[key][0], generator)
                layout = layout_for(types[key], key, kernels, rows=raw.shape[0])
                tensors.update(laid_out(key, raw, types[key], layout))
                if layout != QuantLayout.GGUF:
                    layouts[key] = layout
            save_file(tensors, staging / name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, name))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            del tensors
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        if types:
            config = {**config, "quantization_config": stored_settings(types, layouts)}
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
    # (named_parameters: a tied head is not written twice, as save_pretrained leaves it out)
    return {name: (tuple(t.shape), t.dtype) for name, t in model.named_parameters()}


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


# Each GGUF type's float16 fields (byte offsets in a block) and their size, so that its
# values have about the 0.02 spread of `_random_tensor`'s: a scale d times 4-bit codes
# (Q4), 5-bit (Q5) or 8-bit (Q8); the K types' d multiplies 6-bit (Q4_K, Q5_K) or 8-bit
# (Q6_K) sub-scales as well. The second field of Q4_1, Q5_1 and the K types is a minimum.
_F16_FIELDS = {
    "Q4_0": ((0,), 5e-3), "Q4_1": ((0, 2), 5e-3), "Q5_0": ((0,), 2.5e-3),
    "Q5_1": ((0, 2), 2.5e-3), "Q8_0": ((0,), 2e-4), "Q4_K": ((0, 2), 1.5e-4),
    "Q5_K": ((0, 2), 8e-5), "Q6_K": ((208,), 2e-5), "Q2_K": ((80, 82), 1e-3),
    "Q3_K": ((108,), 4e-4),
}  # fmt: skip


def _quantized_types(
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]], quantized: str | None
) -> dict[str, str]:
    """The weights kept as `quantized` blocks: every matrix whose rows are whole blocks."""
    if quantized is None:
        return {}
    if quantized not in FORMATS:
        raise ValueError(
            f"quantized must be None or one of {', '.join(FORMATS)}, got {quantized!r}"
        )
    size = FORMATS[quantized].block_size
    return {
        name: quantized
        for name, (shape, _) in specs.items()
        if len(shape) == 2 and shape[1] % size == 0
    }


def _blocks_shape(shape: tuple[int, ...], kind: str) -> tuple[int, int]:
    rows, values = shape
    return rows, values // FORMATS[kind].block_size * FORMATS[kind].block_bytes


def random_blocks(kind: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """uint8 [rows, row bytes] of random GGUF `kind` blocks whose float16 fields are about
    `_F16_FIELDS`' size (random bytes there would be NaN or huge), every other byte random."""
    rows, row_bytes = shape
    size = FORMATS[kind].block_bytes
    blocks = torch.randint(
        0, 256, (rows, row_bytes // size, size), dtype=torch.uint8, generator=generator
    )
    offsets, scale = _F16_FIELDS[kind]
    for at in offsets:
        halves = (
            torch.rand(rows, row_bytes // size, generator=generator) * scale + scale / 2
        ).half()
        blocks[..., at : at + 2] = halves.unsqueeze(-1).view(torch.uint8)
    return blocks.reshape(rows, row_bytes)
