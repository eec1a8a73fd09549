"""How much the probes move and how often they repeat: one setting for the planner's
measurements and `offload bench`'s alike, which tests make small."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from offload.sizes import GIB, MIB


@dataclass(frozen=True)
class MeasureSettings:
    """How much each probe moves: bytes copied per link sample (large enough to leave the
    CPU caches far behind), at most `disk_bytes` of the checkpoint read in each of
    `disk_passes` passes (a `probe_file_bytes` file written and read where there is no
    checkpoint), and the untimed and timed repeats of the other figures. Each figure is
    the median of its samples."""

    copy_bytes: int = 256 * MIB
    disk_bytes: int = GIB
    probe_file_bytes: int = 256 * MIB
    disk_passes: int = 3  # a virtual disk's rate varies from one pass to the next
    warmup: int = 2
    repeats: int = 5
    # The device memory the probes may take on a GPU (None: no limit): a quarter of it for
    # a link copy, half for the cut models that time compute.
    max_device_bytes: int | None = None
    # The RAM the probes may take on a CPU given a budget (`cpu_memory_gb`; None: no
    # limit), beside the fixed overhead: a quarter for each of a link copy's two buffers
    # and of the disk probe's two reads in flight, all of it for the cut models that time
    # compute (beside the weights outside their layers: the overhead holds those).
    max_host_bytes: int | None = None

    def on(self, device: torch.device) -> MeasureSettings:
        """These settings with the copy sized to fit `max_device_bytes` on a GPU, or
        `max_host_bytes` on a CPU."""
        limit = self.max_device_bytes if device.type == "cuda" else self.max_host_bytes
        if limit is None:
            return self
        return dataclasses.replace(self, copy_bytes=max(MIB, min(self.copy_bytes, limit // 4)))

    @property
    def max_read_bytes(self) -> int | None:
        """The most one read of the disk probe takes (None: a layer, however large)."""
        return None if self.max_host_bytes is None else max(MIB, self.max_host_bytes // 4)


DEFAULT_SETTINGS = MeasureSettings()  # what `offload plan`, "auto" and `offload bench` use
