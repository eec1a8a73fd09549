"""The parts of an offload config (vLLM's `UVAOffloadConfig`, `PrefetchOffloadConfig`)
and the checks every field goes through: a bad value raises `ConfigError` naming the
field, the value and what is allowed. A part is frozen: checked once, when it is made
(`dataclasses.replace` makes, and checks, a new one)."""

from __future__ import annotations

import enum
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from offload.config.validate import flag, gib, whole_number
from offload.errors import ConfigError, shown
from offload.memory.placement import AUTO, Auto, DiskIO


class Backend(enum.StrEnum):
    """What offloads the weights (vLLM's `offload_backend` values), equal to its string,
    so configs, JSON and flags keep vLLM's shapes. `NONE` is what `selected_backend` says
    when nothing is offloaded; it is not a setting."""

    AUTO = "auto"
    UVA = "uva"
    PREFETCH = "prefetch"
    NONE = "none"


class PrefetchUnit(enum.StrEnum):
    """What one prefetch copy brings in (ours, not vLLM's): whole layers (vLLM's), each
    weight-holding module of a layer, or `AUTO`, chosen by the device (offloader/units.py)."""

    AUTO = "auto"
    LAYER = "layer"
    MODULE = "module"


OffloadBackend = Literal["auto", "uva", "prefetch"]
BACKENDS: tuple[Backend, ...] = (Backend.AUTO, Backend.UVA, Backend.PREFETCH)
PREFETCH_UNITS: tuple[PrefetchUnit, ...] = tuple(PrefetchUnit)


def _as_segments(owner: str, name: str, value: Any) -> frozenset[str]:
    """A set of dot-separated name segments; a string may hold several, comma-separated."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, Iterable) or isinstance(items, bytes | bytearray | Mapping):
        raise ConfigError(f"{owner}.{name} must be a set of name segments, got {shown(value)}")
    segments: set[str] = set()
    for item in items:
        if not isinstance(item, str):
            raise ConfigError(f"{owner}.{name} must hold strings, got {shown(item)}")
        if not item.strip(" ,"):
            raise ConfigError(
                f"{owner}.{name} entries must be name segments such as 'experts', got {item!r}"
            )
        for part in item.split(","):
            part = part.strip()
            if part.startswith(".") or part.endswith(".") or ".." in part:
                raise ConfigError(
                    f"{owner}.{name} entries are dot-separated name segments "
                    f"such as 'experts' or 'mlp.down_proj', got {part!r}"
                )
            if part:
                segments.add(part)
    return frozenset(segments)


def as_bool(owner: str, name: str, value: Any) -> bool:
    return flag(f"{owner}.{name}", value, "true or false")


def set_field(config: Any, name: str, value: Any) -> None:
    """Set a field of a frozen config being made (its `__post_init__` normalizes it)."""
    object.__setattr__(config, name, value)


@dataclass(frozen=True)
class UVAOffloadConfig:
    """UVA (zero-copy) offloading: parameters live in pinned host memory.

    `cpu_offload_gb`: GiB of parameters to move to host memory, filled parameter by
    parameter in module order (0 = none). `cpu_offload_params`: name segments that
    select which parameters may be offloaded (empty = any); matching is by whole
    dot-separated segments, so "experts" matches "mlp.experts.w2_weight" and "w2"
    does not.
    """

    cpu_offload_gb: float | Auto | Literal["auto"] = 0  # "auto" is made `AUTO`
    cpu_offload_params: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.cpu_offload_gb == AUTO:  # the smallest amount that fits (see LLM)
            set_field(self, "cpu_offload_gb", AUTO)
        else:
            gb = gib("uva.cpu_offload_gb", self.cpu_offload_gb, text=True)
            set_field(self, "cpu_offload_gb", gb)
        params = _as_segments("uva", "cpu_offload_params", self.cpu_offload_params)
        set_field(self, "cpu_offload_params", params)


@dataclass(frozen=True)
class PrefetchOffloadConfig:
    """Prefetch offloading: the last `offload_num_in_group` layers of every group of
    `offload_group_size` layers live in host memory and are copied to the device
    `offload_prefetch_step` layers ahead of use. `offload_params` narrows which
    parameters of an offloaded layer move (empty = all), by segment matching.
    """

    offload_group_size: int = 0
    offload_num_in_group: int = 1
    offload_prefetch_step: int = 1
    offload_params: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        for name, least in (
            ("offload_group_size", 0),
            ("offload_num_in_group", 1),
            ("offload_prefetch_step", 0),
        ):
            set_field(self, name, whole_number(f"prefetch.{name}", getattr(self, name), least))
        params = _as_segments("prefetch", "offload_params", self.offload_params)
        set_field(self, "offload_params", params)


DISK_IO: tuple[DiskIO, ...] = tuple(DiskIO)


@dataclass(frozen=True)
class DiskOffloadConfig:
    """The disk tier (ours, not vLLM's): offloaded weights beyond `cpu_memory_gb` GiB of
    host memory stay in the checkpoint's own safetensors files and are read into their
    slot ahead of use, `read_ahead` layers ahead, by `io_threads` threads.

    `cpu_memory_gb`: host memory for offloaded weights (None: no disk tier, every
    offloaded weight in host memory; 0: every offloaded layer streams from disk).
    `offload_folder`: where a checkpoint that is not safetensors is converted once.
    `disk_io`: "direct" reads around the page cache (`O_DIRECT`, or pages dropped after
    use), so the budget holds for the machine; "page-cache" leaves read pages cached;
    "mmap" (CPU compute only) computes on a guarded mapping of the files, with no copy;
    "auto" maps them on the CPU when their streamed bytes are in the page cache already
    at load or fit half the RAM available (the page cache then keeps them after the first
    forward: the kernel's memory, outside the process's budget), else reads directly.
    """

    cpu_memory_gb: float | None = None
    offload_folder: str | None = None
    read_ahead: int = 2
    disk_io: DiskIO = DiskIO.AUTO  # a string is parsed into its member
    io_threads: int = 2

    def __post_init__(self) -> None:
        owner = "disk"
        if self.cpu_memory_gb is not None:
            gb = gib("disk.cpu_memory_gb", self.cpu_memory_gb, text=True)
            set_field(self, "cpu_memory_gb", gb)
        if isinstance(self.offload_folder, os.PathLike):  # (a pathlib.Path, as a str)
            set_field(self, "offload_folder", os.fspath(self.offload_folder))
        if self.offload_folder is not None and not isinstance(self.offload_folder, str):
            raise ConfigError(
                f"{owner}.offload_folder must be a folder path, got {shown(self.offload_folder)}"
            )
        set_field(self, "read_ahead", whole_number("disk.read_ahead", self.read_ahead, 1))
        set_field(self, "io_threads", whole_number("disk.io_threads", self.io_threads, 1))
        if self.disk_io not in DISK_IO:
            raise ConfigError(
                f"{owner}.disk_io must be one of {', '.join(DISK_IO)}, got {shown(self.disk_io)}"
            )
        set_field(self, "disk_io", DiskIO(self.disk_io))

    @property
    def is_active(self) -> bool:
        return self.cpu_memory_gb is not None
