"""The disk tier of the prefetch offloader: units that do not fit the host budget are read
from the model's own safetensors files into their slot each time they are needed.

With the CPU as the compute device, a unit on disk is read straight into its slot by the
I/O threads (the slot ring is the staging ring; compute reads the slot). With a GPU, it
is read into a pinned host staging buffer of its slot, and a staging thread then queues
the host -> device copy on the copy stream; compute waits for the read on the host and
for the copy on the stream. A staging buffer is reused only once the copy out of it is
done. Slots are loaded by the offloader's slot table as for units in host memory, so
units are read `read_ahead` = slots - 1 ahead of the one computing.

With `DiskIO.MMAP` (the CPU only; what AUTO picks when the streamed bytes are in the page
cache already) nothing is read: each streamed parameter is a view of a guarded mapping of
its file (`memory/mapped_files.py`) and compute reads the page cache in place, with no
copy; the kernel is asked to read a unit ahead where its pages are missing. Such units
need no slot.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offload.errors import ModelError
from offload.memory.copy_engine import CopyEngine
from offload.memory.disk_layout import DiskLayout, TensorRange, aligned_empty, plan_layout
from offload.memory.disk_reader import DiskReader, FileStamp, ReadTicket
from offload.memory.host import HostSlab, TensorSpec, should_pin_memory
from offload.memory.mapped_files import MappedFiles, MappingRefused, leases_supported
from offload.memory.page_cache import cached_fraction
from offload.memory.placement import DiskIO
from offload.memory.safetensors import checkpoint_tensors
from offload.offloader.disk_placement import choose_io, place_on_disk

READ_DELAY_S = 0.0  # tests: sleep before every read, to shake out ordering bugs
FORCE_STAGING = False  # tests: the GPU's path (staging buffer, then a copy) on the CPU


@dataclass(frozen=True)
class DiskSettings:
    """What the disk tier needs from the config and the checkpoint."""

    ranges: Mapping[str, TensorRange]  # qualified parameter name -> its bytes in a file
    budget_bytes: int  # host memory for offloaded units; the rest stream from disk
    read_ahead: int = 2  # units read ahead of the one computing (slots - 1)
    io: DiskIO = DiskIO.AUTO  # see DiskOffloadConfig
    num_threads: int = 2


def checkpoint_ranges(
    model: nn.Module, checkpoint: str | Path | Mapping[str, TensorRange] | None
) -> Mapping[str, TensorRange]:
    """Each of `model`'s parameters' bytes in its safetensors files: `checkpoint` as
    given, or read from the headers in its folder (default: where `from_pretrained`
    loaded `model` from). A key is matched to the model's name as it is, or with the
    base model's prefix (a checkpoint of the base model alone)."""
    if isinstance(checkpoint, Mapping):
        return checkpoint
    folder = Path(checkpoint) if checkpoint is not None else _own_folder(model)
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    prefix = getattr(model, "base_model_prefix", "")
    ranges = {}
    for key, stored in checkpoint_tensors(folder).items():
        name = key if key in names or not prefix else f"{prefix}.{key}"
        ranges[name] = TensorRange(stored.path, stored.offset, stored.num_bytes, stored.dtype)
    return ranges


def _own_folder(model: nn.Module) -> Path:
    source = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if source and Path(source).is_dir():
        return Path(source)
    raise ModelError(
        "cpu_memory_gb (the disk tier) streams layers from the model's safetensors files, "
        f"and the model does not say where they are (its name_or_path is {source!r}): "
        "pass the folder as offload.apply(..., checkpoint=)"
    )


def disk_layout(
    ranges: Mapping[str, TensorRange], params: Sequence[tuple[str, nn.Parameter]]
) -> DiskLayout | None:
    """The reads that bring a unit's parameters (qualified names) from the checkpoint, or
    None when one of them cannot be read as it is: not in the checkpoint, stored in
    another dtype or size, non-contiguous, or at an offset its dtype cannot view."""
    found = []
    for name, param in params:
        stored = ranges.get(name)
        if stored is None or not (param.is_meta or param.is_contiguous()):
            return None
        if stored.dtype not in (None, param.dtype):
            return None
        if stored.num_bytes != param.numel() * param.element_size():
            return None
        if stored.offset % param.element_size():
            return None
        found.append(stored)
    return plan_layout(found)


class DiskTier:
    """Places units on disk and reads them into their slots (see the module docstring)."""

    def __init__(self, settings: DiskSettings):
        self.settings = settings
        files = sorted({stored.path for stored in settings.ranges.values()})
        self._stamps = [FileStamp.of(Path(path)) for path in files]
        self._reader: DiskReader | None = None
        self._engine: CopyEngine | None = None
        self._staging: list[torch.Tensor] = []
        self._staged: list[Future | None] = []  # per slot: its staging buffer's last load
        self._issuer: ThreadPoolExecutor | None = None
        self._names: dict[int, str] = {}  # id of a streamed parameter -> its checkpoint name
        self._mapped: MappedFiles | None = None  # DiskIO.MMAP: the files, mapped
        self._mapped_bytes = 0  # bytes of mapped units brought to compute so far
        self.num_units = 0  # units placed on disk
        self.io = DiskIO(settings.io)  # AUTO resolved by `place`

    def place(self, units: Sequence[Any], device: torch.device) -> bool:
        """Give the units that do not fit the host budget a disk layout (`unit.disk`), of
        those whose bytes can be read as they are, so that the fewest bytes come from
        disk; warn about units that must stay in host memory beyond the budget. True when
        some unit streams."""
        qualified = [[(f"{u.name}.{n}", p) for n, p in u.params] for u in units]
        layouts = [disk_layout(self.settings.ranges, named) for named in qualified]
        fixed = sum(u.num_bytes for u, lay in zip(units, layouts, strict=True) if lay is None)
        movable = [i for i, layout in enumerate(layouts) if layout is not None]
        budget = self.settings.budget_bytes - fixed
        on_disk = place_on_disk([units[i].num_bytes for i in movable], budget)
        for i, disk in zip(movable, on_disk, strict=True):
            if disk:
                units[i].disk = layouts[i]
                self._names.update((id(p), name) for name, p in qualified[i])
        if budget < 0:
            warnings.warn(
                f"{-budget / 2**30:.2f} GiB of offloaded weights cannot stream from the "
                "checkpoint as they are (another dtype, or not in its safetensors files) and "
                "stay in host memory beyond cpu_memory_gb",
                UserWarning,
                stacklevel=6,
            )
        streamed = [unit for unit in units if unit.disk is not None]
        self.num_units = len(streamed)
        self.io = self._resolve_io(streamed, device)
        for unit in streamed:
            unit.mapped = self.io == DiskIO.MMAP
        return self.num_units > 0

    def _resolve_io(self, streamed: Sequence[Any], device: torch.device) -> DiskIO:
        requested = self.settings.io
        if FORCE_STAGING:  # the GPU's path, which always reads
            device = torch.device("meta")
        cached = 0.0
        if requested == DiskIO.AUTO and device.type == "cpu" and streamed:
            extents = [e for unit in streamed for e in unit.disk.extents]
            cached = cached_fraction([(e.path, e.file_offset, e.num_bytes) for e in extents])
        return choose_io(requested, device, cached, leases_supported())

    def map_files(self, units: Sequence[Any]) -> None:
        """With DiskIO.MMAP: map the files the streamed units live in (before the slots are
        sized: mapped units need none). Where the files cannot be mapped safely, AUTO
        reads them through the page cache instead; an explicit MMAP is an error."""
        if self.io != DiskIO.MMAP or self._mapped is not None:
            return
        paths = {e.path for unit in units if unit.disk is not None for e in unit.disk.extents}
        try:
            self._mapped = MappedFiles([s for s in self._stamps if s.path in paths])
        except MappingRefused as refused:
            if self.settings.io != DiskIO.AUTO:
                raise ModelError(f"disk_io='mmap': {refused}; use 'page-cache'") from None
            self.io = DiskIO.PAGE_CACHE
            for unit in units:
                unit.mapped = False

    def mapped_views(self, unit: Any) -> list[torch.Tensor]:
        """Each parameter of a mapped unit: its bytes, a uint8 view of its file's mapping."""
        views = []
        for _, param in unit.params:
            stored = self.settings.ranges[self._names[id(param)]]
            views.append(self._mapped.view(Path(stored.path), stored.offset, stored.num_bytes))
        return views

    def start(self, device: torch.device, engine: CopyEngine, slot_bytes: Sequence[int]) -> None:
        """Open the files and, on a GPU, make one pinned staging buffer per slot."""
        settings = self.settings
        self._engine = engine
        if self._mapped is not None:
            return  # nothing is read: compute reads the mappings
        self._reader = DiskReader(self._stamps, num_threads=settings.num_threads, io=self.io)
        if device.type != "cpu" or FORCE_STAGING:
            # Exact-size, page-aligned (O_DIRECT reads into it) and pinned where a GPU
            # copies from it; not the caching host allocator's power-of-two blocks.
            pin_for = device if should_pin_memory(device) else None
            self._staging = [_staging_buffer(size, pin_for) for size in slot_bytes]
            self._staged = [None] * len(slot_bytes)
            # Queues each unit's copy once its read is done, in the order units are loaded.
            self._issuer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-stage")

    def load(self, slot_index: int, slot: torch.Tensor, layout: DiskLayout) -> Any:
        """Start bringing a unit into `slot` (its bytes from the slot's first); return a
        ticket for `wait`."""
        if self._mapped is not None:  # mapped: only ask the kernel for missing pages
            self._mapped.hint(layout.extents)
            self._mapped_bytes += layout.read_bytes
            return None
        if not self._staging:
            return self._reader.read(slot[: layout.num_bytes], layout.extents, after=_delay())
        staging = self._staging[slot_index][: layout.num_bytes]
        previous = self._staged[slot_index]
        released = self._engine.mark_released()  # the slot's last reader, on the compute side
        after = _after_copy_out(self._engine, previous)
        read = self._reader.read(staging, layout.extents, after=after)
        copy = self._issuer.submit(self._copy_in, read, slot[: layout.num_bytes], staging, released)
        self._staged[slot_index] = copy
        return copy

    def _copy_in(self, read: ReadTicket, slot, staging, released) -> Any:
        self._reader.wait(read, count_stall=False)
        return self._engine.copy(slot, staging, after=released)

    def wait(self, ticket: Any) -> None:
        """Make compute wait until the unit of `ticket` is in its slot (a read's fault is
        raised here, in the thread that runs the model)."""
        if self._mapped is not None:  # a changed file is raised here; else the mapping stays
            self._mapped.enter()
            return
        if isinstance(ticket, ReadTicket):
            self._reader.wait(ticket)
            return
        if not ticket.done():
            started = time.perf_counter()
            ticket.exception()
            self._reader.stats.stall_s += time.perf_counter() - started
            self._reader.stats.num_stalls += 1
        self._engine.wait(ticket.result())

    def invalidate(self) -> None:
        """Forget every read and staged copy in flight (after an abandoned forward): none
        lands after this returns, so the slots must all be loaded again."""
        if self._reader is not None:
            self._reader.invalidate()
        if self._issuer is not None:
            self._issuer.submit(_nothing).result()  # stale copies are queued before it
            self._staged = [None] * len(self._staged)

    def leave(self) -> None:
        """No forward runs now (it ended or was abandoned): a mapping of a changed file
        may go."""
        if self._mapped is not None:
            self._mapped.leave()

    def close(self) -> None:
        if self._mapped is not None:
            self._mapped.close()
        if self._issuer is not None:
            self._issuer.shutdown(wait=True)
        if self._reader is not None:
            self._reader.close()

    def read_tensor(self, like: torch.Tensor) -> torch.Tensor:
        """A streamed parameter's value, read from the checkpoint (for `state_dict()`)."""
        stored = self.settings.ranges[self._names[id(like)]]
        if self._mapped is not None:
            self._mapped.enter()  # the mapping stays while it is copied
            try:
                return like.detach().clone()
            finally:
                self._mapped.leave()
        layout = plan_layout([stored])
        buffer = aligned_empty(layout.num_bytes)
        reader = DiskReader(self._stamps, num_threads=1, io=self.io)
        try:
            reader.wait(reader.read(buffer, layout.extents))
        finally:
            reader.close()
        start = layout.tensor_offsets[0]
        raw = buffer[start : start + stored.num_bytes].clone()
        return raw.view(like.dtype).view(like.shape)

    def stats(self) -> dict[str, float | int]:
        mapped = {"disk_io": self.io, "disk_bytes_mapped": self._mapped_bytes}
        if self._reader is None:
            return {"num_disk_units": self.num_units, **mapped}
        read = self._reader.stats
        return {
            "num_disk_units": self.num_units,
            **mapped,
            "disk_bytes_read": read.bytes_read,
            "disk_read_s": read.busy_s,
            "disk_read_gb_per_s": read.read_gb_per_s,
            "disk_stall_s": read.stall_s,
            "disk_num_stalls": read.num_stalls,
            "staging_bytes": sum(buffer.numel() for buffer in self._staging),
        }


def _staging_buffer(num_bytes: int, pin_for: torch.device | None) -> torch.Tensor:
    return HostSlab([TensorSpec((num_bytes,), torch.uint8)], pin_for=pin_for).buffer


def _delay() -> Callable[[], None] | None:
    delay_s = READ_DELAY_S
    return (lambda: time.sleep(delay_s)) if delay_s else None


def _after_copy_out(engine: CopyEngine, previous: Future | None) -> Callable[[], None]:
    """Runs on an I/O thread before a read into a staging buffer: the copy out of the
    buffer's last unit has finished (so the read does not overwrite bytes in flight)."""
    delay = _delay()

    def wait_for_copy_out() -> None:
        if previous is not None:
            engine.host_wait(previous.result())
        if delay is not None:
            delay()

    return wait_for_copy_out


def _nothing() -> None:
    return None
