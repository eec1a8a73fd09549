"""Build a Hugging Face causal LM from its `config.json` without allocating its weights.

The settings are checked before transformers sees them (sizes, quantization, a checkpoint's
own code), and transformers' errors become one line that names the file and the problem.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offload.errors import ModelError, did_you_mean
from offload.memory.placement import AUTO
from offload.memory.safetensors import checkpoint_tensors, json_type
from offload.model.gguf_settings import row_orders, weight_layouts, weight_types
from offload.model.limits import check_parameters, check_sizes
from offload.model.packed_forms import packed_forms
from offload.quant.packed_modules import (
    FORMS_KEY,
    forms_from_setting,
    forms_of,
    forms_setting,
    method_of,
    swap_in_packed,
)
from offload.quant.swap import swap_in_quantized

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

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
    if dtype == AUTO:
        # (vars: transformers warns on reading its deprecated torch_dtype attribute)
        stored = getattr(hf_config, "dtype", None) or vars(hf_config).get("torch_dtype")
        stored = str(stored).removeprefix("torch.") if stored is not None else "float32"
        return DTYPES.get(stored, torch.float32)
    if dtype not in DTYPES:
        raise ModelError(f"dtype must be auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def build_empty(path: Path, dtype: str | torch.dtype, trust_remote_code: bool = False) -> nn.Module:
    """The model from `config.json`, parameters on the meta device, buffers real.

    A checkpoint's own Python code (`auto_map` in config.json) runs only with
    `trust_remote_code=True`; else transformers' built-in class of the `model_type` is used,
    or, without one, the load fails (transformers would otherwise ask on stdin)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config_file, settings = _checked_settings(path)
    hf_config = _hf_config(path, config_file, settings, trust_remote_code)
    torch_dtype = resolve_dtype(dtype, hf_config)
    # (no_init_weights: transformers' own initialisers, run on meta parameters, took
    # 80% of the build: 0.09 s of the default model's; from_pretrained skips them so too)
    with init_empty_weights(include_buffers=False), no_init_weights(), warnings.catch_warnings():
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
    quantized = settings.get("quantization_config")
    if isinstance(quantized, dict) and quantized.get("quant_method") == "gguf":
        types = weight_types(quantized, config_file)
        layouts = weight_layouts(quantized, config_file)
        orders = row_orders(quantized, config_file)
        swap_in_quantized(model, types, config_file, layouts, orders)
    elif isinstance(quantized, dict) and method_of(quantized):
        swap_in_packed(model, _packed_forms(model, path, config_file, quantized))
    return model.eval()


def _read_as_stored(quantized: object) -> bool:
    return isinstance(quantized, dict) and (
        quantized.get("quant_method") == "gguf" or method_of(quantized) is not None
    )


def _packed_forms(model: nn.Module, path: Path, config_file: Path, quantized: dict[str, Any]):
    """The forms of a packed checkpoint's quantized layers: as its tensors say, or as the
    config of a model cut to a few layers carries them (its weights are dummies)."""
    if isinstance(quantized.get(FORMS_KEY), dict):
        return forms_from_setting(quantized[FORMS_KEY])
    try:
        stored = checkpoint_tensors(path)
    except ModelError as error:
        raise ModelError(
            f"{config_file}: quant_method {quantized.get('quant_method')} is read from the "
            f"checkpoint's tensors ({error})"
        ) from None
    return packed_forms(model, quantized, stored, config_file)


def packed_layers(path: Path, trust_remote_code: bool = False) -> dict[str, Any]:
    """The forms of the quantized layers of the packed checkpoint at `path`, as JSON, for
    the config of the model cut to its first layers (`gguf_settings.first_layers_only`)."""
    return forms_setting(forms_of(build_empty(path, AUTO, trust_remote_code)))


def _checked_settings(path: Path) -> tuple[Path, dict[str, Any]]:
    """`path`'s config.json and its settings, checked before transformers reads them."""
    if not path.is_dir():
        raise ModelError(f"model path {path} does not exist or is not a directory{_shapes(path)}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{path} is not a model directory (no config.json)")
    settings = _read_config(config_file)
    quantized = settings.get("quantization_config")
    if quantized is not None and not _read_as_stored(quantized):
        method = quantized.get("quant_method", "unknown") if isinstance(quantized, dict) else "?"
        raise ModelError(
            f"quantized checkpoints are not supported yet (quant_method {method} in "
            f"{config_file}); use the unquantized model"
        )
    check_sizes(settings, config_file)  # before transformers builds lists of that length
    return config_file, settings


def _hf_config(path: Path, config_file: Path, settings: dict[str, Any], trust_remote_code: bool):
    """transformers' config of the model, its errors as one line naming the file."""
    from transformers import AutoConfig

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
    return hf_config


def _needs_own_code(config_file: Path, model_type: object) -> str:
    return (
        f"{config_file}: model_type {json.dumps(model_type)} needs the checkpoint's own Python "
        "code (its auto_map), which offload does not run; trust_remote_code=True "
        "(--trust-remote-code) would run it"
    )


def _shapes(path: Path) -> str:
    """For a bare name (no folder in it): the shipped shapes it could have meant."""
    if path.exists() or len(path.parts) != 1:
        return ""
    from offload.model.configs import shipped

    names = shipped()
    hint = did_you_mean(path.name, names)
    return f"{hint}; the shapes shipped for dummy weights: {', '.join(names)}"


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
