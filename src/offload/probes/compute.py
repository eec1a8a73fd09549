"""Compute per decode step, measured on models of the same config cut to a few layers,
resident on the device with random weights: a decode step against a static KV cache of
the context length, as the engine runs it. A layer's time is the difference between two
such models' steps over the layers between them; the rest of the step (embedding, final
norm, lm_head, masks) is the head."""

from __future__ import annotations

import contextlib
import copy
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from offload.engine.graphs import DecodeStep
from offload.engine.transformers_cache import static_cache
from offload.errors import ModelError
from offload.model.build import build_empty, packed_layers
from offload.model.gguf_settings import first_layers_only
from offload.model.loader import load_model
from offload.planner.shape import ModelShape
from offload.probes.link import Clock
from offload.quant.packed_modules import FORMS_KEY, method_of
from offload.sizes import format_bytes

_EXTRA_LAYERS = 6  # the longer cut model's layers beyond the shorter's, at most
_EXTRA_BYTES = 2**31  # and at most this many bytes of them
_RETRIES = 3  # more pairs of steps, while the layer's time reads as none

# Given a cut model and a batch size: a function that runs decode and returns the seconds
# of one decode step. The default times the engine's step (`_decode_step`); `offload bench`
# times steps of transformers' `generate`, the loop its methods run.
StepTimer = Callable[[torch.nn.Module, int], Callable[[], float]]


class CutFrom(NamedTuple):
    """What the cut models are made from: the config of the checkpoint at `path` (of this
    `shape`), built on `device` and decoding against a KV cache of `context_len`."""

    path: Path
    shape: ModelShape
    device: torch.device
    context_len: int
    trust_remote_code: bool = False


class DecodeTimer:
    """Times decode steps of two models of `path`'s config, cut to the layers up to the
    timed one and to a few more of its kind, built once (so that they can be timed again,
    as `offload bench` does before each run); the shorter one's weights are the longer's
    first layers', shared, so that the two take the memory of one. A layer's time is the
    difference of their steps over the layers between them: layers as they run back to
    back in the whole model, with no hook or clock between them. A step is the engine's
    (`_decode_step`) unless `step_timer` says how to time one. `max_bytes` bounds the
    weights and, at `cache_batch` sequences, the KV caches of the two; `keep_steps=False`
    lets each batch size's steps (and caches) go once it is timed."""

    def __init__(
        self,
        source: CutFrom,
        max_bytes: int | None = None,
        step_timer: StepTimer | None = None,
        *,
        cache_batch: int = 0,
        keep_steps: bool = True,
    ):
        shape = source.shape
        self.count = max(2, shape.timed_layer + 1)  # the shorter model's layers
        cache_layer = _cache_layer_bytes(shape, cache_batch, source.context_len)
        self.extra = _extra_layers(shape, self.count, max_bytes, cache_layer)
        longer = _cut_model(source, self.count + self.extra)[0]
        self.models = [_sharing(source, self.count, longer), longer]
        self.shape, self.device, self.context_len = shape, source.device, source.context_len
        self._step_timer = step_timer or self._engine_step
        self._steps: dict[tuple[int, int], Callable[[], float]] = {}
        self._keep_steps = keep_steps

    def time(
        self, batch_sizes: list[int], warmup: int = 2, repeats: int = 5
    ) -> tuple[list[float], list[float]]:
        """Per batch size: (seconds of one layer, seconds of the rest of a decode step)."""
        layer_s, head_s = [], []
        with torch.inference_mode():
            for batch in batch_sizes:
                short, long = (self._step(which, batch) for which in (0, 1))
                for _ in range(warmup):
                    short(), long()
                # Alternated, so that a drift of the machine's speed touches both alike.
                pairs = [(short(), long()) for _ in range(repeats)]
                for _ in range(_RETRIES):  # a layer takes time: a difference <= 0 is noise
                    if _layer_s(pairs, self.extra) > 0:
                        break
                    pairs += [(short(), long()) for _ in range(repeats)]
                layer = _layer_s(pairs, self.extra)
                short_s = statistics.median(a for a, _ in pairs)
                layer_s.append(layer)
                head_s.append(max(0.0, short_s - self.count * layer))
                if not self._keep_steps:  # (their KV caches go before the next batch's)
                    del short, long
                    self._steps.clear()
        return layer_s, head_s

    def _step(self, which: int, batch: int) -> Callable[[], float]:
        if (which, batch) not in self._steps:
            self._steps[which, batch] = self._step_timer(self.models[which], batch)
        return self._steps[which, batch]

    def _engine_step(self, model: torch.nn.Module, batch: int) -> Callable[[], float]:
        return _engine_timer(model, self.shape.dtype, self.device, batch, self.context_len)


def _layer_s(pairs: list[tuple[float, float]], extra: int) -> float:
    """One layer's seconds from timed (shorter, longer) steps: the median difference over
    the `extra` layers between them."""
    return statistics.median(max(0.0, long - short) / extra for short, long in pairs)


def _extra_layers(
    shape: ModelShape, count: int, max_bytes: int | None, cache_layer_bytes: int = 0
) -> int:
    """The longer cut model's layers beyond the shorter's `count`: a few, as many as the
    layers the model has, `_EXTRA_BYTES` and `max_bytes` allow (the longer model's weights,
    which the shorter shares, and both models' KV caches of `cache_layer_bytes` a layer);
    one at least (a stack of two layers is timed against one of three)."""
    size = max(1, shape.layer_bytes[shape.timed_layer])
    extra = min(shape.num_layers - count, _EXTRA_LAYERS, _EXTRA_BYTES // size)
    if max_bytes is not None:
        # the weights outside the layers, the shorter model's layers, both caches of them
        fixed = shape.outside_bytes + count * (size + 2 * cache_layer_bytes)
        each = size + cache_layer_bytes  # a layer more of the longer model, and its cache
        if fixed + each > max_bytes:
            raise ModelError(
                f"models cut to {count} and {count + 1} layers take "
                f"{format_bytes(fixed + each)}, more than the {format_bytes(max_bytes)} the "
                f"measurement may use"
            )
        extra = min(extra, (max_bytes - fixed) // each)
    return max(1, extra)


def _cache_layer_bytes(shape: ModelShape, batch: int, context_len: int) -> int:
    """One layer's KV cache at `batch` sequences of `context_len` positions."""
    return shape.kv_bytes(batch, context_len) // max(1, shape.num_layers)


STREAM_EVERY_LAYER = {  # vLLM's pattern: every layer offloaded, two slots
    "offload_group_size": 1,
    "offload_num_in_group": 1,
    "offload_prefetch_step": 2,
}


class ForwardCopies:
    """The prefetch backend's copy rate as its copies run, between a forward's layers: a
    model of `path`'s config cut to `count` layers, every one streamed, taking the
    engine's decode step; GB/s = the bytes its copy engine moved over the time it spent
    copying. On a CPU such copies can run far slower than a plain memory copy measured just
    before and after, for long spells, so the copies themselves are timed
    (docs/benchmarks.md)."""

    def __init__(self, source: CutFrom, count: int):
        # Two layers per slot at least: a layer alone in its slot stays there, uncopied.
        count = max(count, 2 * STREAM_EVERY_LAYER["offload_prefetch_step"])
        self.model, self.offloader = _cut_model(source, count, STREAM_EVERY_LAYER)
        self.dtype, self.device = source.shape.dtype, source.device
        self.context_len = source.context_len
        self._steps: dict[int, Callable[[], float]] = {}

    def gb_per_s(self, batch: int) -> float:
        """Decode at `batch` once and return the rate of the copies it made."""
        if batch not in self._steps:
            self._steps[batch] = _engine_timer(
                self.model, self.dtype, self.device, batch, self.context_len
            )
        before = self.offloader.stats()
        with torch.inference_mode():
            self._steps[batch]()
        after = self.offloader.stats()
        seconds = after.copies.copy_s - before.copies.copy_s
        copied = after.bytes_copied - before.bytes_copied
        return copied / seconds / 1e9 if seconds > 0 and copied > 0 else 0.0

    def close(self) -> None:
        self.offloader.close()


def _engine_timer(model, dtype: torch.dtype, device: torch.device, batch: int, context_len: int):
    step = _decode_step(model, dtype, device, batch, context_len)
    clock = Clock(device)
    return lambda: clock.once(step)


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
    max_bytes: int | None = None,
) -> tuple[list[float], list[float]]:
    """Per batch size: (seconds of one layer, seconds of the rest of a decode step), the
    cut models' weights and KV caches (one batch size's at a time) within `max_bytes`
    (None: no limit)."""
    source = CutFrom(path, shape, device, context_len, trust_remote_code)
    timer = DecodeTimer(source, max_bytes, cache_batch=max(batch_sizes), keep_steps=False)
    return timer.time(batch_sizes, warmup, repeats)


def _decode_step(model, dtype: torch.dtype, device: torch.device, batch: int, context_len: int):
    """One decode step writing the last position of a full static cache (the attention
    reads the whole context), with the same inputs every call."""
    cache = static_cache(model.config, batch, context_len, dtype, device)
    mask = torch.ones(batch, context_len, dtype=torch.long, device=device)  # [batch, len]
    positions = torch.arange(context_len, device=device).expand(batch, -1)  # [batch, len]
    step = DecodeStep(model, cache, mask, positions)
    step.position_ids.fill_(context_len - 1)
    step.cache_position.fill_(context_len - 1)

    def last_position() -> torch.Tensor:
        # transformers 5's static layers count the positions written themselves: set back
        # to the last, or each call would write the next one, and past the end fail.
        for layer in getattr(cache, "layers", ()):
            for name, counter in vars(layer).items():  # a tensor, and a sliding layer's int
                if not name.startswith("cumulative_length"):
                    continue
                if isinstance(counter, torch.Tensor):
                    counter.fill_(context_len - 1)
                elif isinstance(counter, int):
                    setattr(layer, name, context_len - 1)
        return step()

    return last_position


def _cut_model(source: CutFrom, count: int, offload: dict | None = None):
    """The model of `source`'s config with its first `count` layers, random weights,
    loaded on its device with `offload` (an OffloadConfig's fields; None: none), and its
    offloader (a config saved to a temporary folder, loaded as `load_format="dummy"` loads
    shapes)."""
    with _cut_folder(source, count) as folder:
        try:
            return load_model(
                folder,
                offload,
                device=source.device,
                dtype=source.shape.dtype,
                load_format="dummy",
                trust_remote_code=source.trust_remote_code,
            )
        except ModelError as error:
            raise ModelError(
                f"cannot build one layer of {source.path} to time it: {error}"
            ) from None


def _sharing(source: CutFrom, count: int, longer: torch.nn.Module) -> torch.nn.Module:
    """The model of `source`'s config cut to `count` layers whose parameters and buffers
    are `longer`'s of the same names (its first layers, and the weights outside them):
    built on the meta device, it allocates no weight of its own."""
    with _cut_folder(source, count) as folder:
        shorter = build_empty(Path(folder), source.shape.dtype, source.trust_remote_code)
    tensors = dict(longer.named_parameters(remove_duplicate=False))
    tensors.update(longer.named_buffers(remove_duplicate=False))
    for name, module in shorter.named_modules(remove_duplicate=False):
        prefix = f"{name}." if name else ""
        for table in (module._parameters, module._buffers):
            for leaf in table:
                if table[leaf] is not None:
                    table[leaf] = tensors[prefix + leaf]
    return shorter.eval()


@contextlib.contextmanager
def _cut_folder(source: CutFrom, count: int):
    """A temporary folder with the config of `source` cut to its first `count` layers
    (and a checkpoint's own code, for a trusted one)."""
    from transformers import AutoConfig

    path, trust_remote_code = source.path, source.trust_remote_code

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    cut = copy.deepcopy(config)
    cut.num_hidden_layers = count
    quantization = getattr(cut, "quantization_config", None)
    if isinstance(quantization, dict):
        if method_of(quantization) and FORMS_KEY not in quantization:  # (read from the files)
            quantization[FORMS_KEY] = packed_layers(Path(path), trust_remote_code)
        first_layers_only(quantization, count)  # (as stored: names per weight)
    derived = isinstance(getattr(type(cut), "layer_types", None), property)
    if isinstance(getattr(cut, "layer_types", None), list) and not derived:
        # A per-layer list follows the count (the last kind repeated past the model's own).
        kinds = cut.layer_types
        cut.layer_types = (kinds + kinds[-1:] * count)[:count]
    with tempfile.TemporaryDirectory(prefix="offload-plan-") as folder:
        cut.save_pretrained(folder)
        for code in Path(path).glob("*.py"):  # a checkpoint's own code, when trusted
            (Path(folder) / code.name).write_bytes(code.read_bytes())
        yield folder
