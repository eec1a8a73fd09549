"""The vocabulary of where a weight lives, how a weight on disk is read, the links bytes
cross, and `AUTO`, the setting left for the library to choose.

Each member is its own string (`Placement.DISK == "disk"`): it prints, formats, hashes
and serializes (JSON, configs, CLI flags, vLLM-style dicts) as that string, so only the
edges (the config, the CLI) ever see text; everything else compares members.
"""

from __future__ import annotations

import enum


class StrChoice(str, enum.Enum):
    """An enum whose members are their values everywhere a string is expected."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(str.__str__(self), spec)


class Placement(StrChoice):
    """Where a weight's bytes live while the model runs."""

    RESIDENT = "resident"  # on the compute device
    HOST = "host"  # host memory, copied in before its layer runs
    HOST_PINNED = "host-pinned"  # page-locked host memory (a GPU copies or reads it)
    DISK = "disk"  # the checkpoint's file, read in before its layer runs
    MAPPED = "mapped"  # the checkpoint's file, mapped: compute reads the page cache in place
    UVA = "uva"  # host memory that kernels read in place over the link


class DiskIO(StrChoice):
    """How weights on disk are brought in (the disk tier's `disk_io`)."""

    AUTO = "auto"  # chosen when the model is loaded (see `offloader.disk_placement.choose_io`)
    DIRECT = "direct"  # read around the page cache (O_DIRECT, or pages dropped after use)
    PAGE_CACHE = "page-cache"  # read through the page cache, the pages left there
    MMAP = "mmap"  # computed on in place from a guarded mapping of the file (CPU only)


class Link(StrChoice):
    """A path bytes cross on their way to compute, each bounded by one measured rate
    (`bench.bound.LINKS`, `probes.limits.Limits.link_gb_per_s`)."""

    MEMCPY = "memcpy"  # a host memory copy
    DISK = "disk"  # a sequential read from the disk (O_DIRECT)
    PAGE_CACHE = "page_cache"  # a read of file pages already in the page cache
    H2D_PINNED = "h2d_pinned"  # host to device, from pinned memory
    H2D_PAGEABLE = "h2d_pageable"  # host to device, from pageable memory


class Auto(enum.StrEnum):
    """A setting left for the library to choose (`cpu_offload_gb`, `dtype`, `device`,
    `load_format`). Its one member equals the string "auto", so a user's plain "auto" is
    the same value, and it prints and serializes (JSON, flags) as that string."""

    AUTO = "auto"

    def __repr__(self) -> str:  # as the string: signatures and config reprs read 'auto'
        return repr(self.value)


AUTO = Auto.AUTO

# The ways a reader reads (the others map the file, or are not resolved yet).
READ_MODES = (DiskIO.DIRECT, DiskIO.PAGE_CACHE)
