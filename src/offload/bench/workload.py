"""The workload every method runs: a model (the default SmolLM2, a folder, or a shipped
shape written once as a random-weight checkpoint), a dtype, batch sizes, prompt and output
lengths, and how many timed rounds."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from offload.bench.checkpoint import write_random_checkpoint
from offload.errors import ConfigError
from offload.llm.spec import ModelSpec, model_spec
from offload.memory.cache_trust import cache_folder
from offload.memory.device import check_device
from offload.memory.placement import AUTO
from offload.memory.safetensors import referenced_files
from offload.model.build import DTYPES, build_empty
from offload.model.configs import CONFIGS, shipped
from offload.model.default import default_model_path, gguf_path
from offload.model.sources import kernels_for
from offload.offloader.layers import find_layers
from offload.probes.settings import DEFAULT_SETTINGS, MeasureSettings
from offload.quant.layouts import packing_of
from offload.quant.quantized import check_quantization
from offload.sizes import compute_dtype, parameter_bytes

SHARD_BYTES = 10**9  # not a multiple of a layer: layers span files, as in real checkpoints
_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


@dataclass(frozen=True)
class Workload:
    """What to run; every field is checked here, before anything loads. `model`: None
    (the default model), a model folder, or a shipped shape name (`llama-3-8b`)."""

    model: str | None = None
    dtype: str = AUTO
    quantization: str | None = None  # "gguf": a GGUF's weights as stored (else float32)
    device: str = AUTO
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    prompt_len: int = 16
    output_len: int = 8
    rounds: int = 5  # medians over interleaved rounds: a virtual machine's speed drifts

    def __post_init__(self) -> None:
        sizes = tuple(self.batch_sizes)
        if not sizes or not all(_is_int(size) and size >= 1 for size in sizes):
            raise ConfigError(
                f"batch_sizes (--batch-sizes) must be one or more integers >= 1, got {list(sizes)}"
            )
        object.__setattr__(self, "batch_sizes", tuple(sorted(set(sizes))))
        # Two tokens at least: the first comes from the prefill, the steps after it decode.
        for name, minimum in (("prompt_len", 1), ("output_len", 2), ("rounds", 1)):
            value = getattr(self, name)
            if not _is_int(value) or value < minimum:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{name} ({flag}) must be an integer >= {minimum}, got {value!r}")
        check_quantization(self.quantization, "quantization (--quantization)")
        if self.dtype != AUTO and self.dtype not in DTYPES:
            raise ConfigError(
                f"dtype (--dtype) must be auto, {', '.join(DTYPES)}; got {self.dtype!r}"
            )


@dataclass(frozen=True)
class Prepared:
    """A workload made concrete: the checkpoint folder, its files, device, dtype and the
    sizes of its decoder layers (`layer_bytes`) and of everything else."""

    workload: Workload
    path: Path
    name: str
    device: torch.device
    dtype: torch.dtype
    files: list[Path]
    total_bytes: int
    layer_bytes: list[int]
    vocab_size: int
    gguf: Path | None = None  # the GGUF file the checkpoint was made from, if one was
    settings: MeasureSettings = DEFAULT_SETTINGS  # how much the probes of the machine move
    spec: ModelSpec | None = None  # the model resolved once and built on meta (read only)

    @property
    def outside_layers_bytes(self) -> int:
        return self.total_bytes - sum(self.layer_bytes)

    def prompt_ids(self, batch: int) -> torch.Tensor:
        """The prompts of a batch: random ids, the same for every method (seeded by the
        batch size), the first few ids (special tokens) left out."""
        generator = torch.Generator().manual_seed(batch)
        low = min(3, self.vocab_size - 1)
        shape = (batch, self.workload.prompt_len)
        return torch.randint(low, self.vocab_size, shape, generator=generator)  # [batch, seq]


def prepare(workload: Workload) -> Prepared:
    """The checkpoint (a shape's random one written into the cache folder on first use)
    and the model's sizes, from a model built on the meta device."""
    device = check_device(workload.device)
    source = _gguf_source(workload.model)
    shape = _random_shape(workload.model)
    if source is not None or (workload.quantization is not None and not shape):
        spec = model_spec(  # (as asked: a .gguf as float32 unless "gguf" is)
            workload.model,
            device=device,
            dtype=workload.dtype,
            quantization=workload.quantization,
            as_stored=False,
        )
        form = "as stored" if workload.quantization else "as float32"
        name = f"{(source or gguf_path()).name} {form}"
    else:  # (a folder as it is: its weights are what the methods read)
        path, name = resolve_checkpoint(
            workload.model,
            workload.dtype,
            check=lambda limit: _check_length(workload, limit),
            quantized="Q4_0" if workload.quantization else None,
            kernels=kernels_for(device),
        )
        spec = ModelSpec(path, device, workload.dtype, None, build_empty(path, workload.dtype))
    path, model = spec.path, spec.empty
    _check_length(workload, getattr(model.config, "max_position_embeddings", None))
    layers = find_layers(model)
    return Prepared(
        workload=workload,
        path=path,
        name=name,
        device=device,
        dtype=compute_dtype(model),
        files=weight_files(path),
        total_bytes=parameter_bytes(model),
        layer_bytes=[parameter_bytes(layer) for layer in layers],
        vocab_size=model.config.vocab_size,
        gguf=source or (gguf_path() if workload.model is None else None),
        spec=spec,
    )


def _gguf_source(model: str | None) -> Path | None:
    """The .gguf file `model` names, if it names one."""
    path = Path(model).expanduser() if model else None
    return path if path is not None and path.suffix == ".gguf" and path.is_file() else None


def _check_length(workload: Workload, limit: object) -> None:
    """Prompt and output within the positions the model has (before a checkpoint is
    written for a shape, or a cache allocated)."""
    length = workload.prompt_len + workload.output_len
    if isinstance(limit, int) and length > limit:
        raise ConfigError(
            f"prompt_len + output_len (--prompt-len, --output-len) must be at most the "
            f"model's {limit} positions, got {workload.prompt_len} + {workload.output_len}"
        )


def resolve_checkpoint(
    model: str | None,
    dtype: str,
    check: Callable[[object], None] = lambda limit: None,
    quantized: str | None = None,
    kernels: str = "gguf",
) -> tuple[Path, str]:
    """(folder with weights, name for the report). A folder with only a config.json, or a
    shipped shape, becomes a random-weight checkpoint in the cache folder (its matrices as
    `quantized` GGUF blocks laid out for `kernels` if given), once `check` passed on its
    max_position_embeddings."""
    if model is None:
        path = default_model_path()
        return path, path.name
    path = Path(model)
    if not path.is_dir() and model in shipped():
        path = CONFIGS / model
    elif not path.is_dir():
        raise ConfigError(
            f"model (--model) must be a model folder or a shipped shape "
            f"({', '.join(shipped())}), got {model!r}"
        )
    if weight_files(path):
        return path, path.name
    if not (path / "config.json").is_file():
        raise ConfigError(f"model (--model) {model!r} is a folder with no config.json")
    config = json.loads((path / "config.json").read_text())
    check(config.get("max_position_embeddings") if isinstance(config, dict) else None)
    form = f"{quantized}, " if quantized else ""
    folder = random_checkpoint(path, dtype, quantized, kernels)
    return folder, f"{path.name} ({form}random weights)"


def random_checkpoint(
    shape: Path, dtype: str, quantized: str | None = None, kernels: str = "gguf"
) -> Path:
    """The random-weight checkpoint of the shape in `shape/config.json` and `dtype`,
    written once into `<cache>/bench/` and reused; its folder is named by a hash of its
    settings, so that a changed shape never reuses a stale one."""
    config = json.loads((shape / "config.json").read_text())
    stored = config.get("dtype") or config.get("torch_dtype") or "float32"
    config["dtype"] = str(stored).removeprefix("torch.") if dtype == AUTO else dtype
    form = f"-{quantized}" if quantized else ""
    keyed = (
        [config, quantized, packing_of(kernels)] if quantized else config
    )  # (float: their old keys)
    key = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:12]
    # (in a checked folder of the user's own; random weights, so not signed: a swapped
    # file changes the timings of a bench, never a model's answers)
    folder = cache_folder("bench") / f"{shape.name}-{config['dtype']}{form}-{key}"
    write_random_checkpoint(folder, config, SHARD_BYTES, quantized=quantized, kernels=kernels)
    return folder


def _random_shape(model: str | None) -> bool:
    """Whether `model` names a shape that runs on random weights (a shipped shape, or a
    folder with a config.json and no weights)."""
    if model is None:
        return False
    path = Path(model)
    if not path.is_dir():
        return model in shipped()
    return (path / "config.json").is_file() and not weight_files(path)


def weight_files(path: Path) -> list[Path]:
    """The files a checkpoint's weights are read from (a .gguf's blocks read in place
    included: `referenced_files`)."""
    files = sorted(file for pattern in _WEIGHT_PATTERNS for file in path.glob(pattern))
    return files + referenced_files(path) if files else files


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
