"""Measurements of one machine for one model shape, dtype and context length: the link's
and the disk's bandwidths and the compute of a decode step at each batch size. Measured
once and cached as JSON in `$OFFLOAD_CACHE_DIR/plans/` (`offload.memory.cache_trust`:
read only from a folder of the user's own, and a file only with its signature), keyed by the machine (CPU model or GPU name), the software (torch, transformers) and the
workload; `remeasure=True` measures again and replaces the cached file."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import hashlib
import itertools
import json
import statistics
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from offload.config import DiskOffloadConfig
from offload.errors import ModelError
from offload.memory import cache_digest
from offload.memory.cache_trust import cache_folder
from offload.memory.host import trim_freed_memory
from offload.memory.safetensors import referenced_files
from offload.planner.fit import MARGIN_BYTES
from offload.planner.measurements import Measured, Measurements
from offload.planner.shape import ModelShape
from offload.probes import disk, link
from offload.probes.compute import CutFrom, ForwardCopies, time_decode
from offload.probes.host import OthersLoad, machine_name, software
from offload.probes.settings import DEFAULT_SETTINGS, MeasureSettings
from offload.sizes import MIB, format_bytes

BUSY = 0.25  # other processes' share of the CPUs above which the measurements say so
_COPIED_LAYERS = 4  # the streamed model that times a CPU's copies in a forward

# Raised whenever a probe measures differently, so that figures cached by the old one are
# not read back (its history is in docs/design.md).
PROBES_VERSION = 4


def cache_key_of(measured: Measurements) -> str:
    """The cache key: how it is measured, the machine, the software and the workload,
    not the figures."""
    return cache_key(
        PROBES_VERSION,
        measured.machine,
        measured.software,
        measured.device_type,
        measured.model_digest,
        measured.dtype,
        measured.context_len,
        measured.batch_sizes,
    )


def cache_key(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:24]


def plans_dir() -> Path:
    """The cached measurements' folder, made and checked (`cache_folder`)."""
    return cache_folder("plans")


def record(
    device: torch.device,
    shape: ModelShape,
    context_len: int,
    batch_sizes: list[int],
    **figures: object,
) -> Measurements:
    """A `Measurements` of this machine and software for `shape` at `context_len`, stamped
    now, with `figures` (its fields) as given and the others empty: what `measure` fills
    in, and what `offload bench` makes from the rates and compute it measured in a run."""
    empty = {"layer_s": [], "head_s": [], "link_gb_per_s": 0.0, "disk_gb_per_s": 0.0}
    return Measurements(
        machine=machine_name(device),
        software=software(),
        device_type=device.type,
        model_digest=shape.digest,
        dtype=str(shape.dtype).removeprefix("torch."),
        context_len=context_len,
        batch_sizes=list(batch_sizes),
        measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **{**empty, **figures},
    )


def measure(
    path: Path,
    shape: ModelShape,
    device: torch.device,
    batch_sizes: list[int],
    context_len: int,
    *,
    remeasure: bool = False,
    settings: MeasureSettings = DEFAULT_SETTINGS,
    trust_remote_code: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Measured:
    """The measurements for this machine and workload: from the cache, or measured now
    (`remeasure`: always) and cached. `progress` is told each part as it starts. A machine
    whose other processes kept its CPUs busy while measuring is said so in the notes."""
    measured = record(device, shape, context_len, batch_sizes)
    cached = plans_dir() / f"{cache_key_of(measured)}.json"
    found = None if remeasure else _load(cached)
    if found is not None:
        return Measured(found, cached, True)
    target = _Target(path, shape, device, settings.on(device), trust_remote_code)
    say = progress or (lambda _: None)
    load = OthersLoad()
    try:
        say("measuring the link (copies to the device)")
        _measure_links(measured, target)
        say("measuring the disk")
        _measure_disk(measured, target)
        say(f"timing decode steps at batch {', '.join(map(str, batch_sizes))}")
        _measure_compute(measured, target)
        if device.type == "cpu":
            # The compute probe's models and caches go, and malloc hands their pages back,
            # before the next probe builds its own: a GGUF's plan peaked far higher without
            # (docs/benchmarks.md, "Issue 47 closed out, batch invariance (2026-11-29,
            # twenty-fifth session)").
            _let_go()
            _measure_forward_copies(measured, target)
            _let_go()
    finally:
        if device.type == "cuda":  # the probes' memory goes back before the model loads
            gc.collect()
            torch.cuda.empty_cache()
    busy = load.fraction()
    if busy > BUSY:
        measured.notes.append(
            f"the machine was busy while measuring: other processes used {busy:.0%} of its "
            f"CPUs, so the timings may be slow; on a quieter machine --remeasure measures again"
        )
    _save(cached, measured)
    return Measured(measured, cached, False)


def _let_go() -> None:
    gc.collect()
    trim_freed_memory()


def _load(path: Path) -> Measurements | None:
    """The cached measurements, or None: missing (measure), or not valid (thrown away
    with one warning, and measured again)."""
    try:
        text = cache_digest.read_signed(path).decode()
        return Measurements.from_json(text)
    except OSError:
        return None
    except (cache_digest.NotSigned, ValueError) as error:  # (json's errors: ValueErrors)
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        warnings.warn(
            f"the cached measurements in {path} are not valid ({reason}); measuring again",
            UserWarning,
            stacklevel=3,
        )
        with contextlib.suppress(OSError):
            path.unlink()
        return None


def _save(path: Path, measured: Measurements) -> None:
    """Written whole or not at all (a reader never sees half a file)."""
    cache_digest.write_signed(path, measured.to_json().encode())


class _Target(NamedTuple):
    """What is measured, where, and how much each probe moves."""

    path: Path
    shape: ModelShape
    device: torch.device
    settings: MeasureSettings
    trust_remote_code: bool


def _measure_links(measured: Measurements, target: _Target) -> None:
    device, s = target.device, target.settings
    measured.link_gb_per_s = link.link_gb_per_s(device, s.copy_bytes, s.warmup, s.repeats)
    measured.uva_gb_per_s = link.uva_gb_per_s(device, s.copy_bytes, s.warmup, s.repeats)


def _measure_forward_copies(measured: Measurements, target: _Target) -> None:
    """On a CPU, the link is what the prefetch backend's copies get between a forward's
    layers at the largest batch (a cut model, every layer streamed): such copies drift
    apart from a plain memory copy's rate (docs/benchmarks.md). Where the cut model cannot
    stream, the memory copy stays."""
    path, shape, device, s, trust_remote_code = target
    need = _forward_copies_bytes(shape, _COPIED_LAYERS, max(measured.batch_sizes), measured)
    if s.max_host_bytes is not None and need > s.max_host_bytes:
        measured.notes.append(
            f"copies in a forward not measured (a model of {_COPIED_LAYERS} streamed layers "
            f"takes {format_bytes(need)}, more than the {format_bytes(s.max_host_bytes)} "
            f"budget): a memory copy's rate"
        )
        return
    try:
        source = CutFrom(path, shape, device, measured.context_len, trust_remote_code)
        copies = ForwardCopies(source, _COPIED_LAYERS)
    except ModelError as error:
        measured.notes.append(f"copies in a forward not measured ({error}): a memory copy's rate")
        return
    try:
        batch = max(measured.batch_sizes)
        for _ in range(s.warmup):
            copies.gb_per_s(batch)
        rates = [copies.gb_per_s(batch) for _ in range(s.repeats)]
        measured.link_gb_per_s = statistics.median(rates) or measured.link_gb_per_s
    finally:
        copies.close()


def _forward_copies_bytes(shape: ModelShape, count: int, batch: int, measured: Measurements) -> int:
    """What `ForwardCopies` of `count` layers takes beside the weights outside them: the
    layers, two slots of a layer (at most: a CPU's slots hold modules), the KV cache of
    `batch` sequences, activations."""
    size = shape.layer_bytes[shape.timed_layer]
    kv = shape.kv_bytes(batch, measured.context_len) * count // max(1, shape.num_layers)
    return (count + 2) * size + kv + shape.activation_bytes


def _measure_disk(measured: Measurements, target: _Target) -> None:
    path, stack_name, s = target.path, target.shape.stack_name, target.settings
    threads = DiskOffloadConfig().io_threads  # as many as the disk tier reads with
    try:
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        files += referenced_files(path) if files else []  # (a .gguf's blocks read in place)
        if files:
            reads = checkpoint_reads(path, stack_name)
            _read_rates(measured, files, s, threads, reads)
            measured.disk_source = "the checkpoint's files" + (
                ", its layers in the order they run" if reads else ""
            )
            return
        with disk.probe_file(plans_dir(), s.probe_file_bytes) as probe:
            probing = dataclasses.replace(s, disk_bytes=s.probe_file_bytes)
            _read_rates(measured, [probe], probing, threads, None)
        measured.disk_source = f"a {s.probe_file_bytes // MIB} MiB file in {plans_dir()}"
    except (OSError, ModelError) as error:  # the disk tier could not read here either
        measured.notes.append(f"disk not measured ({error}): no disk tier planned")


def checkpoint_reads(path: Path, stack_name: str) -> list | None:
    """The disk tier's reads of the checkpoint's layers in execution order (None where
    its tensor names do not say the layers: read the files in order)."""
    try:
        return disk.layer_reads(path, stack_name) or None
    except ModelError:  # not a checkpoint this reads: its files in order
        return None


def _read_rates(
    measured: Measurements,
    files: list[Path],
    settings: MeasureSettings,
    threads: int,
    reads: list | None,
) -> None:
    """The disk's rate alone and, on a CPU, beside compute: medians of the settings'
    passes, alternated (a virtual disk's rate drifts), each read within its budget. The
    files' pages cached before are read back in after, so that a warm checkpoint stays
    warm."""
    computing = [False, True] if measured.device_type == "cpu" else [False]
    s = settings
    with disk.kept_warm(files):
        rates = [
            [
                disk.disk_gb_per_s(
                    files,
                    s.disk_bytes,
                    threads,
                    computing=busy,
                    reads=reads,
                    max_read_bytes=s.max_read_bytes,
                )
                for busy in computing
            ]
            for _ in range(s.disk_passes)
        ]
    measured.disk_gb_per_s = statistics.median(alone for alone, *_ in rates)
    if measured.device_type == "cpu":
        measured.disk_busy_gb_per_s = statistics.median(busy for _, busy in rates)


def _measure_compute(measured: Measurements, target: _Target) -> None:
    path, shape, device, s, trust_remote_code = target
    try:
        measured.layer_s, measured.head_s = time_decode(
            path,
            shape,
            device,
            measured.batch_sizes,
            measured.context_len,
            warmup=s.warmup,
            repeats=s.repeats,
            trust_remote_code=trust_remote_code,
            max_bytes=_compute_bytes(target),
        )
    except ModelError as error:
        measured.notes.append(f"compute not measured ({error}): predictions count bytes only")
        measured.layer_s = [0.0] * len(measured.batch_sizes)
        measured.head_s = [0.0] * len(measured.batch_sizes)
        return
    for name in ("layer_s", "head_s"):  # (noise made a plan call larger batches slower)
        setattr(measured, name, consistent_times(measured.batch_sizes, getattr(measured, name)))


def _compute_bytes(target: _Target) -> int | None:
    """What the cut models that time compute may take (their weights, outside the layers
    too, and KV caches): half the device budget on a GPU; on a CPU given a budget, the
    budget less a prefill's activations and the allocator's slack, beside the weights
    outside the layers (the fixed overhead holds those); None: no limit."""
    shape, s = target.shape, target.settings
    if target.device.type == "cuda":
        return None if s.max_device_bytes is None else s.max_device_bytes // 2
    if s.max_host_bytes is None:
        return None
    return s.max_host_bytes + shape.outside_bytes - shape.activation_bytes - MARGIN_BYTES


def consistent_times(batch_sizes: list[int], seconds: list[float]) -> list[float]:
    """Step times by batch size made physical: a larger batch takes no less time a step,
    and no more time a sequence, than a smaller one (timing noise breaks either; a plan
    made on it called larger batches slower). Each time is kept within the bounds the
    smaller batches set, in order."""
    order = sorted(range(len(batch_sizes)), key=batch_sizes.__getitem__)
    result = list(seconds)
    for previous, current in itertools.pairwise(order):
        low = result[previous]
        high = result[previous] * batch_sizes[current] / batch_sizes[previous]
        result[current] = min(max(result[current], low), high)
    return result
