"""Compute per decode step when no resident run gives it: a model of the workload's shapes
with two decoder layers, kept resident with random weights, timed layer by layer; the full
model's step is that step less its layers, plus the median layer time for every layer."""

from __future__ import annotations

import statistics
import time

import torch

from offload.bench.decode import greedy_decode
from offload.bench.machine import synchronize
from offload.bench.workload import Prepared
from offload.offloader.layers import find_layers

_NUM_LAYERS = 2


class _LayerClock:
    """Each forward of the model, the wall time of each of its layers (the device
    synchronised at both ends of a layer)."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.device = device
        self.forwards: list[list[float]] = []
        self._started = 0.0
        model.register_forward_pre_hook(lambda module, args: self.forwards.append([]))
        for layer in find_layers(model):
            layer.register_forward_pre_hook(self._start)
            layer.register_forward_hook(self._stop)

    def _start(self, module, args) -> None:
        synchronize(self.device)
        self._started = time.perf_counter()

    def _stop(self, module, args, output) -> None:
        synchronize(self.device)
        self.forwards[-1].append(time.perf_counter() - self._started)


def estimate_compute_s(prepared: Prepared) -> dict[int, float] | None:
    """Compute per decode step at each batch size, or None where the model's layer count
    cannot be changed (no `num_hidden_layers` in its config)."""
    model = _two_layer_model(prepared)
    if model is None:
        return None
    clock = _LayerClock(model, prepared.device)
    num_layers = len(prepared.layer_bytes)
    estimates: dict[int, float] = {}
    for batch in prepared.workload.batch_sizes:
        ids = prepared.prompt_ids(batch)
        greedy_decode(model, ids, prepared.workload.output_len, prepared.device)  # warm-up
        per_step = []
        for _ in range(prepared.workload.rounds):
            clock.forwards.clear()
            decoded = greedy_decode(model, ids, prepared.workload.output_len, prepared.device)
            for step_s, layer_s in zip(decoded.step_s, clock.forwards[1:], strict=True):
                per_step.append(step_s - sum(layer_s) + num_layers * statistics.median(layer_s))
        estimates[batch] = statistics.median(per_step)
    return estimates


def _two_layer_model(prepared: Prepared) -> torch.nn.Module | None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(prepared.path, trust_remote_code=False)
    if not isinstance(getattr(config, "num_hidden_layers", None), int):
        return None
    config.num_hidden_layers = _NUM_LAYERS
    if isinstance(getattr(config, "layer_types", None), list):  # per-layer lists follow
        config.layer_types = config.layer_types[:_NUM_LAYERS]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=prepared.dtype)
    return model.to(prepared.device).eval()
