"""`offload demo`: offload a real model, answer a question, and say what moved."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import torch

from offload.api import apply
from offload.cli.defaults import whole_stack_config
from offload.config import Backend, OffloadConfig
from offload.errors import OffloadError
from offload.model.build import build_empty
from offload.model.default import default_model_path
from offload.offloader.base import BaseOffloader
from offload.sizes import MIB, parameter_bytes


def load_pretrained(path: str | Path | None):
    """A causal LM and its tokenizer from a safetensors directory (default model if None)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path) if path is not None else default_model_path()
    if not (path / "config.json").is_file():
        raise OffloadError(f"{path} is not a model directory (no config.json)")
    build_empty(path, torch.float32)  # one-line errors for custom code or absurd sizes
    # A checkpoint's own code (auto_map) never runs: transformers' built-in classes only.
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, trust_remote_code=False
    ).eval()
    return model, tokenizer


def greedy(model, tokenizer, prompt: str, max_tokens: int) -> tuple[torch.Tensor, float]:
    """Greedy chat completion: the new token ids, and tokens per second."""
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    ).to(model.device)
    started = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    new_tokens = output[0, inputs["input_ids"].shape[1] :].cpu()
    return new_tokens, len(new_tokens) / (time.perf_counter() - started)


def run_demo(
    model_path: str | None, prompt: str, max_tokens: int, device: str, config: OffloadConfig
) -> str:
    model, tokenizer = load_pretrained(model_path)
    model.to(device)
    resident_ids, resident_rate = greedy(model, tokenizer, prompt, max_tokens)
    if config.selected_backend == Backend.NONE:
        config = whole_stack_config(model)  # no flags: offload every layer
    offloader = apply(model, config)
    offloaded_ids, offloaded_rate = greedy(model, tokenizer, prompt, max_tokens)
    answer = tokenizer.decode(offloaded_ids, skip_special_tokens=True)
    same = torch.equal(resident_ids, offloaded_ids)
    return "\n".join(
        [
            f"Q: {prompt}",
            f"A: {answer}",
            _summary(model, offloader),
            f"tokens identical to the resident model: {'yes' if same else 'NO'}",
            f"greedy decode: resident {resident_rate:.1f} tok/s, offloaded {offloaded_rate:.1f} tok/s",
        ]
    )


def _summary(model, offloader: BaseOffloader) -> str:
    manifest = offloader.manifest()
    model_bytes = parameter_bytes(model)
    kinds = Counter(f"{e.location}, {e.access}" for e in manifest)
    modules = {e.module for e in manifest}
    stats = offloader.stats()
    lines = [
        f"offloaded {len(manifest)} parameters, {offloader.offloaded_bytes / MIB:.1f} MiB "
        f"of {model_bytes / MIB:.1f} MiB, from {len(modules)} modules "
        f"({type(offloader).__name__}): " + "; ".join(f"{n} {k}" for k, n in kinds.items()),
        f"host memory held: {stats.host_bytes / MIB:.1f} MiB "
        f"(pinned {stats.pinned_bytes / MIB:.1f} MiB)",
    ]
    if manifest:
        first, last = manifest[0], manifest[-1]
        lines.append(f"first moved: {first.name} ({first.num_bytes} bytes), last: {last.name}")
    if stats.bytes_copied:
        lines.append(f"copied to the compute device on demand: {stats.bytes_copied / MIB:.1f} MiB")
    return "\n".join(lines)
