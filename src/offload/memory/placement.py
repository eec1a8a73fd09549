"""The vocabulary of where a weight lives and how a weight on disk is read.

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


# The ways a reader reads (the others map the file, or are not resolved yet).
READ_MODES = (DiskIO.DIRECT, DiskIO.PAGE_CACHE)
