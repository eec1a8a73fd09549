"""Build a Hugging Face causal LM without allocating its weights, then stream each tensor
from the checkpoint straight into where the offload plan puts it.

Offloaded tensors are read from the file directly into their layer's host slab; resident
ones go through one reusable host staging buffer to the device. The model is never
whole in host memory, nor on the device.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch import nn

from offload.api import finish, prepare
from offload.config import OffloadConfig
from offload.errors import ModelError
from offload.memory.host import HostSlab, TensorSpec, should_pin_memory
from offload.model.configs import resolve
from offload.model.limits import check_parameters, check_sizes
from offload.model.merges import Assembled, Converted, assemble, transformers_renaming
from offload.model.safetensors import (
    CheckpointError,
    StoredTensor,
    json_type,
    read_header,
    read_into,
)
from offload.offloader.base import BaseOffloader

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOAD_FORMATS = ("auto", "safetensors", "dummy")

try:  # transformers' strict config checks, whose messages name the field and the problem
    from huggingface_hub.errors import StrictDataclassError

    _SELF_EXPLAINING: tuple[type[Exception], ...] = (ValueError, StrictDataclassError)
except ImportError:
    _SELF_EXPLAINING = (ValueError,)


def resolve_dtype(dtype: str | torch.dtype, hf_config: Any) -> torch.dtype:
    """`auto` is the checkpoint's own dtype (float32 when it names none)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ModelError(f"dtype must be auto, {', '.join(DTYPES)}; got {dtype}")
        return dtype
    if dtype == "auto":
        stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        stored = str(stored).removeprefix("torch.") if stored is not None else "float32"
        return DTYPES.get(stored, torch.float32)
    if dtype not in DTYPES:
        raise ModelError(f"dtype must be auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def checkpoint_tensors(path: Path) -> dict[str, StoredTensor]:
    """Every tensor of the checkpoint in `path`: one `model.safetensors`, or the shards
    that `model.safetensors.index.json` names."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = _shard_files(index)
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{path} has no model.safetensors or model.safetensors.index.json")
    tensors: dict[str, StoredTensor] = {}
    for name in files:
        for key, entry in read_header(path / name).items():
            if key in tensors:
                raise CheckpointError(
                    f"{path}: tensor {key!r} is in both {tensors[key].path.name} and {name}; "
                    "each tensor must be in one shard"
                )
            tensors[key] = entry
    return tensors


def _shard_files(index: Path) -> list[str]:
    """The shard files an index names, each a relative path inside the model folder."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError, IndexError, RecursionError):
        weight_map = None
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f"{index} is not a valid safetensors index (it must be a JSON object whose "
            '"weight_map" maps tensor names to shard files)'
        )
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name:
            raise CheckpointError(
                f"{index}: the shard of tensor {key!r} must be a file name, got {json.dumps(name)}"
            )
        if PurePosixPath(name).is_absolute() or ".." in PurePosixPath(name).parts:
            raise CheckpointError(
                f"{index}: shard {name!r} of tensor {key!r} is outside the model folder; "
                "shards must be named relative to the folder, without '..'"
            )
    return sorted(set(weight_map.values()))


def build_empty(path: Path, dtype: str | torch.dtype, trust_remote_code: bool = False) -> nn.Module:
    """The model from `config.json`, parameters on the meta device, buffers real.

    A checkpoint's own Python code (`auto_map` in config.json) runs only with
    `trust_remote_code=True`; else transformers' built-in class of the `model_type` is used,
    or, without one, the load fails (transformers would otherwise ask on stdin)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    if not path.is_dir():
        raise ModelError(f"model path {path} does not exist or is not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{path} is not a model directory (no config.json)")
    settings = _read_config(config_file)
    quantized = settings.get("quantization_config")
    if quantized is not None:
        method = quantized.get("quant_method", "unknown") if isinstance(quantized, dict) else "?"
        raise ModelError(
            f"quantized checkpoints are not supported yet (quant_method {method} in "
            f"{config_file}); use the unquantized model"
        )
    check_sizes(settings, config_file)  # before transformers builds lists of that length
    try:
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as error:  # transformers raises many types for bad settings
        model_type = settings.get("model_type")
        if not trust_remote_code and "auto_map" in settings:
            raise ModelError(_needs_own_code(config_file, model_type)) from None
        if not isinstance(model_type, str) or model_type not in _known_model_types():
            problem = f"unknown or unsupported architecture ({_describe(error)})"
        else:
            problem = f"invalid {model_type} settings ({_describe(error)})"
        raise ModelError(f"{config_file}: {problem}") from None
    check_parameters(hf_config, config_file)
    heads = getattr(hf_config, "num_attention_heads", None)
    kv_heads = getattr(hf_config, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv_heads, int) and (kv_heads < 1 or heads % kv_heads):
        raise ModelError(
            f"{config_file}: num_key_value_heads ({kv_heads}) must divide num_attention_heads "
            f"({heads}): each key/value head serves a whole group of query heads"
        )
    torch_dtype = resolve_dtype(dtype, hf_config)
    with init_empty_weights(include_buffers=False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = AutoModelForCausalLM.from_config(
                hf_config, dtype=torch_dtype, trust_remote_code=trust_remote_code
            )
        except ValueError as error:
            if not trust_remote_code and "auto_map" in settings:
                raise ModelError(_needs_own_code(config_file, settings.get("model_type"))) from None
            raise ModelError(
                f"{path}: not a causal language model transformers can build ({_describe(error)})"
            ) from None
        except Exception as error:  # e.g. a negative size or an unknown activation
            raise ModelError(
                f"{config_file}: transformers cannot build the model from these settings "
                f"({_describe(error)})"
            ) from None
    model.tie_weights()  # tied names become one parameter before anything is placed
    return model.eval()


def _needs_own_code(config_file: Path, model_type: object) -> str:
    return (
        f"{config_file}: model_type {json.dumps(model_type)} needs the checkpoint's own Python "
        "code (its auto_map), which offload does not run; trust_remote_code=True "
        "(--trust-remote-code) would run it"
    )


def _read_config(config_file: Path) -> dict[str, Any]:
    try:
        settings = json.loads(config_file.read_text())
    except OSError as error:
        raise ModelError(f"cannot read {config_file}: {error.strerror or error}") from None
    except (ValueError, RecursionError) as error:
        raise ModelError(f"{config_file} is not valid JSON ({_describe(error)})") from None
    if not isinstance(settings, dict):
        raise ModelError(
            f"{config_file} must hold a JSON object of model settings, got {json_type(settings)}"
        )
    return settings


def _known_model_types() -> set[str]:
    try:
        from transformers import CONFIG_MAPPING

        return set(CONFIG_MAPPING.keys())
    except (ImportError, AttributeError):
        return set()


def _describe(error: BaseException, limit: int = 300) -> str:
    """One line of at most `limit` characters for a third-party error; bare messages such
    as a KeyError's key get the error's type in front."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    if not isinstance(error, _SELF_EXPLAINING):
        text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_model(
    path: str | Path,
    config: OffloadConfig | Mapping[str, Any] | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "auto",
    load_format: str = "auto",
    progress: bool = False,
    trust_remote_code: bool = False,
) -> tuple[nn.Module, BaseOffloader]:
    """Load a causal LM from a safetensors directory with `config`'s offloading already in
    place. `load_format="dummy"` (vLLM's name) fills random weights of the right shapes
    instead, for benchmarks of large shapes without a checkpoint (only `config.json` is read;
    `path` may also name a shipped config, e.g. "llama-3-8b": see `offload.model.configs`).
    The checkpoint's own code runs only with `trust_remote_code=True` (see `build_empty`)."""
    if load_format not in LOAD_FORMATS:
        raise ModelError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}"
        )
    path = resolve(path) if load_format == "dummy" else Path(path)
    device = torch.device(device)
    model = build_empty(path, dtype, trust_remote_code)
    stored = {} if load_format == "dummy" else checkpoint_tensors(path)
    targets = _targets(model, stored, dummy=load_format == "dummy")
    offloader = prepare(model, config, device, deferred=True)
    _fill(model, offloader, targets, device, progress)
    return model, finish(offloader)


def _targets(
    model: nn.Module, stored: dict[str, StoredTensor], dummy: bool
) -> dict[str, StoredTensor | None]:
    """Checkpoint entry of each parameter and persistent buffer (tied names share one
    tensor: the first name the checkpoint has wins). Checked before anything is allocated."""
    names = dict(model.named_parameters(remove_duplicate=False))
    names.update(
        (n, b) for n, b in model.named_buffers(remove_duplicate=False) if n in model.state_dict()
    )
    if dummy:
        return dict.fromkeys(dict(model.named_parameters()))
    shapes = {name: tuple(tensor.shape) for name, tensor in names.items()}
    stored, unexpected = _by_model_name(model, stored, shapes)
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in names.items():
        by_tensor.setdefault(id(tensor), []).append(name)
    targets: dict[str, StoredTensor | None] = {}
    missing = []
    for aliases in by_tensor.values():
        found = [stored[a] for a in aliases if a in stored]
        if found:
            targets[aliases[0]] = found[0]
        elif not names[aliases[0]].is_meta:  # a buffer computed at construction
            continue
        else:
            missing.append(aliases[0])
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {sorted(unexpected)[:3]}"
        raise ModelError(f"the checkpoint does not match the model's parameters: {what}")
    for name, entry in targets.items():
        if tuple(names[name].shape) != entry.shape:
            raise ModelError(
                f"{name}: checkpoint shape {entry.shape}, model expects {tuple(names[name].shape)}"
            )
    return targets


def _by_model_name(
    model: nn.Module, stored: dict[str, StoredTensor], shapes: Mapping[str, tuple[int, ...]]
) -> tuple[dict[str, StoredTensor | Assembled], list[str]]:
    """The checkpoint's tensors under the model's names, and the checkpoint keys that are
    none of them. Keys are renamed as transformers' `from_pretrained` does: first the
    architecture's own renamings (GPT-NeoX's `embed_out` is `lm_head`), then the base
    model's prefix is added for a checkpoint of the base model alone (Llama's `norm.weight`
    is `model.norm.weight`). A key the model has as it is keeps its name. Parts that
    transformers merges (a mixture's experts) become one `Assembled` parameter."""
    names = shapes.keys()
    prefix = getattr(model, "base_model_prefix", "")
    # Keys transformers drops without complaint: the model's own list (GPT-2's attention
    # masks) and the rotary inverse frequencies that older checkpoints saved as weights.
    ignored = [*(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())]
    ignored.append(r"rotary_emb\.inv_freq$")
    by_name: dict[str, StoredTensor | Assembled] = {}
    merged: dict[str, list[tuple[StoredTensor, Converted]]] = {}
    unexpected = []
    for key, (name, converted) in transformers_renaming(model, stored).items():
        if name not in names and key in names:
            name, converted = key, None
        if name not in names and prefix and f"{prefix}.{name}" in names:
            name = f"{prefix}.{name}"
        if name not in names:
            if not any(re.search(pattern, key) for pattern in ignored):
                unexpected.append(key)
            continue
        if converted is not None:
            merged.setdefault(name, []).append((stored[key], converted))
            continue
        if name in by_name:
            raise ModelError(
                f"the checkpoint has both {by_name[name].name!r} and {key!r} for the "
                f"model's {name!r}; a checkpoint has one tensor per parameter"
            )
        by_name[name] = stored[key]
    for name, parts in merged.items():
        if name in by_name:
            raise ModelError(
                f"the checkpoint has {by_name[name].name!r} and parts of it for the model's {name!r}"
            )
        by_name[name] = assemble(name, shapes[name], parts)
    return by_name, unexpected


def _fill(model, offloader, targets, device: torch.device, progress: bool) -> None:
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    largest = max((_largest_read(e) for e in targets.values() if e is not None), default=0)
    staging = _Staging(largest, device)
    generator = torch.Generator().manual_seed(0)
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
        host = offloader.host_view(tensor)
        destination = host if host is not None else tensor.data
        if entry is None:
            _dummy(destination, generator)
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
        read_into(entry, destination)  # file -> final host memory, nothing in between
    else:
        destination.copy_(staging.read(entry))  # file -> staging -> device, casting if needed


def _largest_read(entry: StoredTensor | Assembled) -> int:
    return entry.largest_part_bytes if isinstance(entry, Assembled) else entry.num_bytes


class _Staging:
    """One reusable host buffer (pinned when a GPU reads it) for tensors that do not go
    straight from the file to their final host memory."""

    def __init__(self, num_bytes: int, device: torch.device):
        pin = should_pin_memory(device)
        self._slab = HostSlab(
            [TensorSpec((num_bytes,), torch.uint8)], pin_for=device if pin else None
        )

    def read(self, entry: StoredTensor) -> torch.Tensor:
        raw = self._slab.buffer[: entry.num_bytes]
        read_into(entry, raw)
        return raw.view(entry.dtype).view(entry.shape)


def _dummy(destination: torch.Tensor, generator: torch.Generator) -> None:
    """Random weights of a plausible scale: ones for vectors (norms), N(0, 0.02) else."""
    if destination.dim() <= 1:
        destination.fill_(1.0)
        return
    values = torch.empty(destination.shape, dtype=torch.float32).normal_(
        0.0, 0.02, generator=generator
    )
    destination.copy_(values)
