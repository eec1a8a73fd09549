"""Compute per decode step, measured on a model of the same config cut to the layers up
to the timed one (two at least: a stack needs two), resident on the device with random weights: a
decode step against a static KV cache of the context length, as the engine runs it. The
timed layer's share is read by hooks around it; the rest of the step (embedding, final
norm, lm_head, masks) is the head."""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch

from offload.engine.graphs import DecodeStep
from offload.engine.transformers_cache import static_cache
from offload.errors import ModelError
from offload.model.loader import load_model
from offload.planner.probes import Clock
from offload.planner.shape import ModelShape


class _LayerClock:
    """The time of each forward of one module: CUDA events recorded by hooks on a GPU
    (read after the step), the wall clock on a CPU."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.on_gpu = device.type == "cuda"
        self.spans: list = []
        self._handles = [
            module.register_forward_pre_hook(lambda *_: self._mark()),
            module.register_forward_hook(lambda *_: self._mark()),
        ]

    def _mark(self) -> None:
        if self.on_gpu:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.spans.append(event)
        else:
            self.spans.append(time.perf_counter())

    def take_seconds(self) -> float:
        """The time between the last two marks (the device has finished the step)."""
        start, end = self.spans[-2:]
        self.spans.clear()
        return start.elapsed_time(end) / 1e3 if self.on_gpu else end - start

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def time_decode(
    path: Path,
    shape: ModelShape,
    device: torch.device,
    batch_sizes: list[int],
    context_len: int,
    *,
    warmup: int = 2,
    repeats: int = 5,
    trust_remote_code: bool = False,
) -> tuple[list[float], list[float]]:
    """Per batch size: (seconds of one layer, seconds of the rest of a decode step)."""
    count = max(2, shape.timed_layer + 1)  # the layers the cut model keeps
    model = _cut_model(path, count, shape.dtype, device, trust_remote_code)
    layer = model.get_submodule(shape.stack_name)[shape.timed_layer]
    clock, layer_clock = Clock(device), _LayerClock(layer, device)
    layer_s, head_s = [], []
    try:
        with torch.inference_mode():
            for batch in batch_sizes:
                step = _decode_step(model, shape.dtype, device, batch, context_len)
                for _ in range(warmup):
                    step()
                steps, layers = [], []
                for _ in range(repeats):
                    steps.append(clock.once(step))
                    layers.append(layer_clock.take_seconds())
                layer_s.append(statistics.median(layers))
                # The other layers of the cut model take as long as the timed one.
                head_s.append(max(0.0, statistics.median(steps) - count * layer_s[-1]))
    finally:
        layer_clock.remove()
    return layer_s, head_s


def _decode_step(model, dtype: torch.dtype, device: torch.device, batch: int, context_len: int):
    """One decode step writing the last position of a full static cache (the attention
    reads the whole context), with the same inputs every call."""
    cache = static_cache(model.config, batch, context_len, dtype, device)
    mask = torch.ones(batch, context_len, dtype=torch.long, device=device)  # [batch, len]
    positions = torch.arange(context_len, device=device).expand(batch, -1)  # [batch, len]
    step = DecodeStep(model, cache, mask, positions)
    step.position_ids.fill_(context_len - 1)
    step.cache_position.fill_(context_len - 1)
    return step


def _cut_model(path: Path, count: int, dtype: torch.dtype, device, trust_remote_code: bool):
    """The model of `path`'s config with its first `count` layers, random weights, loaded
    on `device` (a config saved to a temporary folder, loaded as `load_format="dummy"`
    loads shapes)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    cut = copy.deepcopy(config)
    cut.num_hidden_layers = count
    derived = isinstance(getattr(type(cut), "layer_types", None), property)
    if isinstance(getattr(cut, "layer_types", None), list) and not derived:
        cut.layer_types = cut.layer_types[:count]  # a per-layer list follows the count
    with tempfile.TemporaryDirectory(prefix="offload-plan-") as folder:
        cut.save_pretrained(folder)
        for code in Path(path).glob("*.py"):  # a checkpoint's own code, when trusted
            (Path(folder) / code.name).write_bytes(code.read_bytes())
        try:
            model, _ = load_model(
                folder,
                device=device,
                dtype=dtype,
                load_format="dummy",
                trust_remote_code=trust_remote_code,
            )
        except ModelError as error:
            raise ModelError(f"cannot build one layer of {path} to time it: {error}") from None
    return model
