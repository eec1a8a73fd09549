"""The disk tier of the prefetch offloader: units that do not fit the host budget are read
from the model's own safetensors files into their slot each time they are needed.

The tier decides which units stream (`place`) and how (`DiskIO`, AUTO resolved), then
opens the one source they all come from (`sources/`): with the CPU as the compute device,
a read straight into the slot (the slot ring is the staging ring); with a GPU, a read
into a pinned staging buffer of the slot, then a copy on the copy stream; with
`DiskIO.MMAP` (the CPU only; what AUTO picks when the streamed bytes are in the page cache
already), no read at all: compute reads a guarded mapping of the files in place, and such
units need no slot. Slots are loaded by the offloader's slot table as for units in host
memory, so units are read `read_ahead` = slots - 1 ahead of the one computing.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from offload.errors import ModelError
from offload.memory.copy_engine import CopyEngine
from offload.memory.disk_layout import (
    MAP_ALIGN,
    DiskLayout,
    TensorRange,
    aligned_empty,
    maps_exactly,
    plan_layout,
)
from offload.memory.disk_reader import DiskReader, FileStamp
from offload.memory.host import HostSlab, TensorSpec, available_ram_bytes, should_pin_memory
from offload.memory.mapped_files import MappedFiles, MappingRefused, leases_supported
from offload.memory.page_cache import cached_fraction
from offload.memory.placement import READ_MODES, DiskIO
from offload.offloader.disk_placement import (
    AUTO_CACHE_SHARE,
    choose_io,
    fit_stack,
    place_on_disk,
)
from offload.offloader.disk_ranges import disk_layout
from offload.offloader.sources import DirectRead, DiskSource, MappedRead, StagedRead, Unopened
from offload.offloader.stats import DiskStats


@dataclass(frozen=True)
class ReadHooks:
    """Switches for tests (the defaults are what runs otherwise)."""

    delay_s: float = 0.0  # sleep before every read, to shake out ordering bugs
    force_staging: bool = False  # the GPU's path (staging buffer, then a copy) on the CPU


@dataclass(frozen=True)
class DiskSettings:
    """What the disk tier needs from the config and the checkpoint."""

    ranges: Mapping[str, TensorRange]  # qualified parameter name -> its bytes in a file
    budget_bytes: int  # host memory for offloaded units; the rest stream from disk
    read_ahead: int = 2  # units read ahead of the one computing (slots - 1)
    io: DiskIO = DiskIO.AUTO  # see DiskOffloadConfig
    num_threads: int = 2
    # True: `budget_bytes` bounds all the RAM the stack takes, slots and touched pages of
    # mapped files included (`fit_stack`: the process budget of `LLM` on a CPU); False:
    # the units kept in host memory only (`offload.apply`'s cpu_memory_gb).
    whole_stack: bool = False


class DiskTier:
    """Places units on disk and opens the source they are brought in from (see the module
    docstring): a read into the slot, a staged read, or a mapping, chosen once."""

    reads_whole_layers = True  # one read of a layer's runs, not seven small ones

    def __init__(self, settings: DiskSettings, hooks: ReadHooks = ReadHooks()):
        self.settings = settings
        self.hooks = hooks
        files = sorted({stored.path for stored in settings.ranges.values()})
        self._stamps = [FileStamp.of(Path(path)) for path in files]
        self._names: dict[int, str] = {}  # id of a streamed parameter -> its checkpoint name
        self._source: DiskSource = Unopened()  # what `map_files` or `start` opens
        self._single: DiskReader | None = None  # reads values one by one (`read_tensor`)
        self._single_lock = threading.Lock()
        self.num_units = 0  # units placed on disk
        self.io = DiskIO(settings.io)  # AUTO resolved by `place`
        self.ram_bytes = 0  # (whole_stack) the most RAM the stack's placement takes
        self._misaligned = 0  # streamable matrices not at a multiple of MAP_ALIGN in a file

    def place(self, units: Sequence[Any], device: torch.device, num_slots: int = 2) -> bool:
        """Give the units that do not fit the host budget a disk layout (`unit.disk`), of
        those whose bytes can be read as they are, so that the fewest bytes come from
        disk; warn about units that must stay in host memory beyond the budget. True when
        some unit streams. `num_slots`: the slot ring's size when some unit streams."""
        qualified = [[(f"{u.name}.{n}", p) for n, p in u.params] for u in units]
        layouts = [disk_layout(self.settings.ranges, named) for named in qualified]
        movable = [i for i, layout in enumerate(layouts) if layout is not None]
        self._misaligned = sum(
            not maps_exactly(self.settings.ranges[name].offset, param.dim())
            for i in movable
            for name, param in qualified[i]
        )
        if self.settings.whole_stack:
            in_ram = self._fit(units, layouts, movable, device, num_slots)
        else:
            in_ram = self._kept_within_budget(units, movable)
        for i in movable:
            if not in_ram[i]:
                units[i].disk = layouts[i]
                self._names.update((id(p), name) for name, p in qualified[i])
        streamed = [unit for unit in units if unit.disk is not None]
        self.num_units = len(streamed)
        if not self.settings.whole_stack:
            self.io = self._resolve_io([unit.disk for unit in streamed], device)
        for unit in streamed:
            unit.mapped = self.io == DiskIO.MMAP
        return self.num_units > 0

    def _kept_within_budget(self, units: Sequence[Any], movable: list[int]) -> list[bool]:
        """Per unit, whether it stays in host memory: those that cannot stream, and the
        movable ones whose sizes fill `budget_bytes` best."""
        fixed = sum(u.num_bytes for i, u in enumerate(units) if i not in set(movable))
        budget = self.settings.budget_bytes - fixed
        on_disk = place_on_disk([units[i].num_bytes for i in movable], budget)
        in_ram = [True] * len(units)
        for i, disk in zip(movable, on_disk, strict=True):
            in_ram[i] = not disk
        if budget < 0:
            warnings.warn(
                f"{-budget / 2**30:.2f} GiB of offloaded weights cannot stream from the "
                "checkpoint as they are (another dtype, or not in its safetensors files) and "
                "stay in host memory beyond cpu_memory_gb",
                UserWarning,
                stacklevel=7,
            )
        return in_ram

    def _fit(self, units, layouts, movable: list[int], device, num_slots: int) -> list[bool]:
        """`fit_stack` of the units in the whole-stack budget. Units kept in RAM are mapped
        (their pages held) where the files are, else host slabs."""
        self.io = self._resolve_io([layouts[i] for i in movable], device)
        slot_bytes = [
            max(u.num_bytes, lay.num_bytes if lay is not None else 0)
            for u, lay in zip(units, layouts, strict=True)
        ]
        fit = fit_stack(
            [u.num_bytes for u in units],
            slot_bytes,
            movable,
            self.settings.budget_bytes,
            num_slots,
            self.io,
            asked=self.settings.io != DiskIO.AUTO,
        )
        self.io, self.ram_bytes = fit.io, fit.ram_bytes
        in_ram = list(fit.in_ram)
        if self.io == DiskIO.MMAP:  # kept units are mapped too, their pages held
            for i in movable:
                units[i].pages_held, in_ram[i] = in_ram[i], False
        return in_ram

    def _resolve_io(self, streamed: Sequence[DiskLayout], device: torch.device) -> DiskIO:
        """The way units on disk (their `streamed` layouts) are brought in, AUTO resolved
        from how much of them the page cache holds (`choose_io`)."""
        requested = self.settings.io
        if self.hooks.force_staging:  # the GPU's path, which always reads
            device = torch.device("meta")
        cached, fits = 0.0, False
        if requested == DiskIO.AUTO and device.type == "cpu" and streamed:
            extents = [e for layout in streamed for e in layout.extents]
            cached = cached_fraction([(e.path, e.file_offset, e.num_bytes) for e in extents])
            streamed_bytes = sum(e.num_bytes for e in extents)
            fits = streamed_bytes <= AUTO_CACHE_SHARE * available_ram_bytes()
        if requested == DiskIO.MMAP and self._misaligned:
            raise ModelError(
                f"disk_io='mmap' computes on weights where they lie in the checkpoint, where "
                f"{self._misaligned} matrices do not start at a multiple of {MAP_ALIGN} bytes "
                "in their files (a product's sums depend on where its weight starts): use "
                "'direct' or 'page-cache', which move each weight to an aligned home"
            )
        can_map = leases_supported() and not self._misaligned
        return choose_io(requested, device, cached, can_map, fits)

    def map_files(self, units: Sequence[Any]) -> None:
        """With DiskIO.MMAP: map the files the streamed units live in (before the slots are
        sized: mapped units need none). Where the files cannot be mapped safely, AUTO
        reads them through the page cache instead; an explicit MMAP is an error."""
        if self.io != DiskIO.MMAP or not self.num_units or not isinstance(self._source, Unopened):
            return  # (once)
        paths = {e.path for unit in units if unit.disk is not None for e in unit.disk.extents}
        try:
            mapped = MappedFiles([s for s in self._stamps if s.path in paths])
        except MappingRefused as refused:
            if self.settings.io != DiskIO.AUTO:
                raise ModelError(f"disk_io='mmap': {refused}; use 'page-cache'") from None
            self.io = DiskIO.PAGE_CACHE
            for unit in units:
                unit.mapped = unit.pages_held = False
            if self.settings.whole_stack:  # (placed for a mapping: slots were not counted)
                warnings.warn(
                    f"{refused}: the layers stream through the page cache into slots, "
                    "which may take more RAM than the budget",
                    UserWarning,
                    stacklevel=5,
                )
            return
        self._source = MappedRead(mapped, self._stored)

    @property
    def read_ahead(self) -> int:
        """Units read ahead of the one computing (the slot ring is one more)."""
        return self.settings.read_ahead

    @property
    def disk_io(self) -> DiskIO | None:
        """How units on disk are brought in; None where no unit streams."""
        return self.io if self.num_units else None

    def start(
        self, device: torch.device, engine: CopyEngine, slot_bytes: Sequence[int]
    ) -> DiskSource:
        """Open the files for reading (unless no unit streams, or they are mapped) and
        return the source of the units on disk: on a GPU, a staged read through one
        pinned staging buffer per slot; on the CPU, a read straight into the slot."""
        if not self.num_units or self.io not in READ_MODES:
            return self._source
        num_threads, delay_s = self.settings.num_threads, self.hooks.delay_s
        reader = DiskReader(self._stamps, num_threads=num_threads, io=self.io, delay_s=delay_s)
        if device.type != "cpu" or self.hooks.force_staging:
            # Exact-size, page-aligned (O_DIRECT reads into it) and pinned where a GPU
            # copies from it; not the caching host allocator's power-of-two blocks.
            pin_for = device if should_pin_memory(device) else None
            staging = [_staging_buffer(size, pin_for) for size in slot_bytes]
            self._source = StagedRead(reader, engine, staging)
        else:
            self._source = DirectRead(reader)
        return self._source

    def invalidate(self) -> None:
        """Forget every load in flight (after an abandoned forward): none lands after
        this returns, so the slots must all be loaded again."""
        self._source.invalidate()

    def failed_transiently(self) -> bool:
        """A read failed on an unchanged file: the next forward forgets the slots (which
        restarts the reads) and tries again."""
        return self._source.failed_transiently()

    def leave(self) -> None:
        """No forward runs now (it ended or was abandoned): a mapping of a changed file
        may go."""
        self._source.leave()

    def close(self) -> None:
        self._source.close()
        with self._single_lock:
            if self._single is not None:
                self._single.close()
                self._single = None

    def read_tensor(self, like: torch.Tensor) -> torch.Tensor:
        """A streamed parameter's value, read from the checkpoint (for `state_dict()`)."""
        stored = self._stored(like)
        return self._source.value_of(like, functools.partial(self._read_value, stored))

    def _read_value(self, stored: TensorRange, like: torch.Tensor) -> torch.Tensor:
        layout = plan_layout([stored])
        buffer = aligned_empty(layout.num_bytes)
        with self._single_lock:  # one reader (one thread) kept for every value read
            if self._single is None:
                # A value read whole: mapped (or not yet resolved) files through the cache.
                io = self.io if self.io in (DiskIO.DIRECT, DiskIO.PAGE_CACHE) else DiskIO.PAGE_CACHE
                self._single = DiskReader(self._stamps, num_threads=1, io=io)
            reader = self._single
        try:
            reader.wait(reader.read(buffer, layout.extents, moves=layout.moves))
        except BaseException:
            self._drop_single(reader)  # a fault ends a reader: the next read opens another
            raise
        start = layout.tensor_offsets[0]
        raw = buffer[start : start + stored.num_bytes].clone()
        return raw.view(like.dtype).view(like.shape)

    def _drop_single(self, reader: DiskReader) -> None:
        with self._single_lock:
            if self._single is reader:
                self._single = None
        reader.close()

    def stats(self) -> DiskStats:
        return replace(
            self._source.stats(), io=self.io, num_units=self.num_units, ram_bytes=self.ram_bytes
        )

    def _stored(self, param: torch.Tensor) -> TensorRange:
        return self.settings.ranges[self._names[id(param)]]


class NoDiskTier:
    """No disk tier: every offloaded unit stays in host memory."""

    reads_whole_layers = False
    num_units = 0
    disk_io = None
    read_ahead = 0

    def place(self, units: Sequence[Any], device: torch.device, num_slots: int = 2) -> bool:
        return False

    def map_files(self, units: Sequence[Any]) -> None:
        pass

    def start(
        self, device: torch.device, engine: CopyEngine, slot_bytes: Sequence[int]
    ) -> DiskSource:
        return Unopened()

    def failed_transiently(self) -> bool:
        return False

    def invalidate(self) -> None:
        pass

    def leave(self) -> None:
        pass

    def close(self) -> None:
        pass

    def read_tensor(self, like: torch.Tensor) -> torch.Tensor:
        raise KeyError("no host copy of an offloaded parameter")

    def stats(self) -> DiskStats:
        return DiskStats()


def _staging_buffer(num_bytes: int, pin_for: torch.device | None) -> torch.Tensor:
    return HostSlab([TensorSpec((num_bytes,), torch.uint8)], pin_for=pin_for).buffer
