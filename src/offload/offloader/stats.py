"""`OffloadStats`: what an offloader holds and what it has moved, as one typed record.

The engine's `TransferStats`, bench's figures and the probes read these fields directly;
nothing goes through string keys."""

from __future__ import annotations

from dataclasses import dataclass, field

from offload.memory.copy_engine import CopyStats
from offload.memory.disk_reader import ReadStats
from offload.memory.placement import DiskIO


@dataclass(frozen=True)
class DiskStats:
    """The disk tier: how it reads, how many units stream from the checkpoint's files,
    and what those reads moved."""

    io: DiskIO | None = None  # None: no disk tier
    num_units: int = 0
    bytes_read: int = 0
    read_s: float = 0.0  # wall time with at least one read in flight
    stall_s: float = 0.0  # time compute waited for a read
    num_stalls: int = 0
    bytes_mapped: int = 0  # computed on in place from mapped files: nothing is read
    staging_bytes: int = 0  # host buffers the reads land in before a copy to the device
    ram_bytes: int = 0  # (a process budget) the most RAM the stack takes: see `fit_stack`

    @classmethod
    def of_reads(cls, reads: ReadStats, staging_bytes: int = 0) -> DiskStats:
        return cls(
            bytes_read=reads.bytes_read,
            read_s=reads.busy_s,
            stall_s=reads.stall_s,
            num_stalls=reads.num_stalls,
            staging_bytes=staging_bytes,
        )

    @property
    def read_gb_per_s(self) -> float:
        return self.bytes_read / self.read_s / 1e9 if self.read_s > 0 else 0.0


@dataclass(frozen=True)
class OffloadStats:
    """An offloader's figures at one moment. The prefetch fields stay zero (and `unit`
    None) for the UVA offloader; `disk.io` is None without a disk tier."""

    offloaded_bytes: int = 0
    num_offloaded_params: int = 0
    host_bytes: int = 0  # host memory holding offloaded weights
    pinned_bytes: int = 0  # of which page-locked (whole pages)
    copies: CopyStats = field(default_factory=CopyStats)  # weights brought to the device
    unit: str | None = None  # what one prefetch unit is: "layer" or "module"
    num_offloaded_layers: int = 0
    num_units: int = 0
    num_slots: int = 0
    device_staging_bytes: int = 0  # the slots units are copied into
    largest_layer_bytes: int = 0
    disk: DiskStats = field(default_factory=DiskStats)

    @property
    def bytes_copied(self) -> int:
        """Weight bytes copied to the compute device so far."""
        return self.copies.bytes_copied
