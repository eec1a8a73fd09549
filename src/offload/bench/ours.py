"""The reference (every weight resident) and this library's methods, each loaded through
the public loader (`offload.model.loader.load_model`) with an `OffloadConfig` dict."""

from __future__ import annotations

from typing import Any, ClassVar

from offload.bench.method import Figures, Method, MethodUnavailable, from_pretrained
from offload.memory.host import meminfo_bytes
from offload.memory.placement import DiskIO, Link
from offload.offloader.uva import UVAOffloader
from offload.planner import layouts
from offload.planner.layouts import Layout
from offload.planner.shape import ModelShape
from offload.sizes import GIB, format_bytes

# Resident weights may take this share of the free memory, so that the others fit beside.
_RESIDENT_SHARE = {"cuda": 0.9, "cpu": 0.5}


class Resident(Method):
    name = "resident"
    label = "resident (transformers, no offloading)"

    def load(self) -> None:
        self._check_fits()
        if self.prepared.workload.quantization is not None:  # (transformers cannot read it)
            from offload.model.loader import load_model

            self.model, offloader = load_model(
                self.prepared.path, device=self.device, dtype=self.prepared.dtype
            )
            offloader.close()  # (nothing is offloaded: it holds no thread)
            return
        cuda = self.device.type == "cuda"
        self.model = from_pretrained(self.prepared, device_map=str(self.device) if cuda else None)

    def _check_fits(self) -> None:
        import torch

        if self.device.type == "cuda":
            free_bytes = torch.cuda.mem_get_info(self.device)[0]
        else:
            free_bytes = meminfo_bytes("MemAvailable") or 0
        needed = self.prepared.total_bytes
        if needed > _RESIDENT_SHARE[self.device.type] * free_bytes:
            raise MethodUnavailable(
                f"does not fit: {format_bytes(needed)} of weights, "
                f"{format_bytes(free_bytes)} free on {self.device}"
            )

    def figures(self) -> Figures:
        return Figures()

    def layout(self, shape: ModelShape) -> Layout:
        return layouts.resident(shape)


class Ours(Method):
    """One of our configs; `config()` is the OffloadConfig dict it loads with."""

    is_ours = True
    settings: ClassVar[dict[str, Any]] = {}

    def config(self) -> dict[str, Any]:
        return dict(self.settings)

    def setting(self) -> dict[str, Any]:
        return self.config()

    def load(self) -> None:
        from offload.model.loader import load_model

        self.model, self.offloader = load_model(
            self.prepared.path, self.config(), device=self.device, dtype=self.prepared.dtype
        )
        self.loaded()

    def loaded(self) -> None:
        """Note how a disk tier reads: "auto" picks a way when the model loads."""
        self.disk_io = self.offloader.disk_io
        self.reads_disk = self.disk_io == DiskIO.DIRECT
        self.reads_page_cache = self.disk_io == DiskIO.PAGE_CACHE

    def figures(self) -> Figures:
        stats = self.offloader.stats()
        offloaded = stats.offloaded_bytes
        if isinstance(self.offloader, UVAOffloader):
            # A GPU kernel reads each offloaded weight from host memory at every forward (or
            # a copy brings it in, where views are off); on a CPU it is already in place.
            cuda = self.device.type == "cuda"
            moved = {Link.H2D_PINNED: offloaded * self.num_forwards} if cuda else {}
            return Figures(offloaded_bytes=offloaded, moved_bytes=moved, stall_s=None)
        moved = {self.copy_link: stats.bytes_copied}
        stall_s = stats.copies.stall_s
        if self.disk_io is not None:  # the disk tier streams some layers
            # Mapped files are computed on in place, as resident weights are: nothing moves.
            # Reads around the page cache are bounded by the disk, others by the page cache.
            read_link = Link.DISK if self.disk_io == DiskIO.DIRECT else Link.PAGE_CACHE
            moved[read_link] = moved.get(read_link, 0) + stats.disk.bytes_read
            stall_s += stats.disk.stall_s
        return Figures(offloaded_bytes=offloaded, moved_bytes=moved, stall_s=stall_s)

    def close(self) -> None:
        if self.model is not None:
            self.offloader.close()  # ends its copy and read threads
            self.offloader = None
        super().close()


class UVA(Ours):
    name = "uva"
    label = "ours UVA, the first half of the layers"

    def config(self) -> dict[str, Any]:
        layers = self.prepared.layer_bytes
        return {"cpu_offload_gb": sum(layers[: len(layers) // 2]) / GIB}

    def layout(self, shape: ModelShape) -> Layout | None:
        return layouts.uva(shape, sum(shape.layer_bytes[: shape.num_layers // 2]))


class Prefetch(Ours):
    """vLLM's prefetch layout (`pattern`: group size, number in group, prefetch step)."""

    pattern: ClassVar[tuple[int, int, int]]

    def config(self) -> dict[str, Any]:
        group_size, num_in_group, prefetch_step = self.pattern
        return {
            "offload_group_size": group_size,
            "offload_num_in_group": num_in_group,
            "offload_prefetch_step": prefetch_step,
        }

    def layout(self, shape: ModelShape) -> Layout:
        return layouts.prefetch(
            shape, *self.pattern, host_budget_bytes=2**62, disk_io=DiskIO.DIRECT
        )


class PrefetchAll(Prefetch):
    name, label = "prefetch-all", "ours prefetch, every layer, step 2"
    pattern = (1, 1, 2)


class PrefetchHalf(Prefetch):
    name, label = "prefetch-half", "ours prefetch, group 2 num 1 (half the layers), step 1"
    pattern = (2, 1, 1)


class Disk(Ours):
    name = "disk"
    label = "ours disk tier, every layer off RAM (cpu_memory_gb=0, default disk_io)"
    settings: ClassVar[dict[str, Any]] = {"cpu_memory_gb": 0}

    def setting(self) -> dict[str, Any]:
        return {**self.config(), "disk_io_chosen": self.disk_io}

    def layout(self, shape: ModelShape) -> Layout:
        # Every layer (group 1), in read_ahead + 1 slots, none of them in host memory.
        return layouts.prefetch(shape, 1, 1, 1, host_budget_bytes=0, disk_io=self.disk_io)


class DiskDirect(Disk):
    """The tier as it runs on a cold checkpoint: every layer read with O_DIRECT."""

    name = "disk-direct"
    label = "ours disk tier, every layer off RAM, O_DIRECT reads (a cold checkpoint)"
    settings: ClassVar[dict[str, Any]] = {"cpu_memory_gb": 0, "disk_io": DiskIO.DIRECT}
