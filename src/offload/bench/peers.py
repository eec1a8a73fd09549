"""The peers, on the same checkpoint: accelerate's `device_map` with `max_memory` and an
`offload_folder`, accelerate's `disk_offload`, and (on a GPU) diffusers' group offloading
applied to the same transformers model."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import torch

from offload.bench.method import (
    Figures,
    Method,
    MethodUnavailable,
    from_pretrained,
    module_bytes_by_place,
)
from offload.memory.placement import Link


class _Accelerate(Method):
    """accelerate's hooks copy every offloaded weight to the compute device at every
    forward, from pageable memory; weights on disk are memory-mapped files read through
    the page cache first."""

    def __init__(self, prepared):
        super().__init__(prepared)
        self.folder: Path | None = None
        self.bytes_by_place: dict[str, int] = {}

    def _make_folder(self) -> Path:
        self.folder = Path(tempfile.mkdtemp(prefix=f"offload-bench-{self.name}-"))
        return self.folder

    def figures(self) -> Figures:
        # Off the compute device: on a GPU what is in RAM or on disk, on a CPU what is on disk.
        places = ("cpu", "disk") if self.device.type == "cuda" else ("disk",)
        on_host = sum(self.bytes_by_place.get(place, 0) for place in places)
        on_disk = self.bytes_by_place.get("disk", 0)
        moved: dict[str, float] = {Link.PAGE_CACHE: on_disk * self.num_forwards}
        if self.device.type == "cuda":
            moved[Link.H2D_PAGEABLE] = on_host * self.num_forwards
        return Figures(offloaded_bytes=on_host, moved_bytes=moved, stall_s=None)

    def close(self) -> None:
        super().close()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


class AccelerateMap(_Accelerate):
    name = "accelerate-map"
    label = "accelerate device_map, max_memory: half the layers off the device"

    def max_memory(self) -> dict[Any, int]:
        """Room on the compute device for everything but half the layers, plus the largest
        layer (accelerate keeps that much free for the layer being brought in)."""
        layers = self.prepared.layer_bytes
        kept = self.prepared.outside_layers_bytes + sum(layers[len(layers) // 2 :])
        device_bytes = kept + max(layers, default=0)
        if self.device.type == "cuda":
            host_bytes = 4 * self.prepared.total_bytes  # the rest in RAM, none on disk
            return {self.device.index or 0: device_bytes, "cpu": host_bytes}
        return {"cpu": device_bytes}  # on a CPU, what is off the device is on disk

    def setting(self) -> dict[str, Any]:
        return {
            "device_map": "auto",
            "max_memory": {str(k): v for k, v in self.max_memory().items()},
        }

    def load(self) -> None:
        self.model = from_pretrained(
            self.prepared,
            device_map="auto",
            max_memory=self.max_memory(),
            offload_folder=str(self._make_folder()),
        )
        self.bytes_by_place = module_bytes_by_place(self.model, self.model.hf_device_map)


class AccelerateDisk(_Accelerate):
    name = "accelerate-disk"
    label = "accelerate disk_offload, every weight on disk"

    def setting(self) -> dict[str, Any]:
        return {"disk_offload": True, "execution_device": str(self.device)}

    def load(self) -> None:
        import accelerate

        model = from_pretrained(self.prepared)
        accelerate.disk_offload(model, str(self._make_folder()), execution_device=self.device)
        self.model = model
        self.bytes_by_place = {"disk": self.prepared.total_bytes}


class Diffusers(Method):
    name = "diffusers"
    label = "diffusers group offloading, block level, 1 block per group, with a stream"
    _SETTING: ClassVar[dict[str, Any]] = {
        "offload_type": "block_level",
        "num_blocks_per_group": 1,
        "use_stream": True,
    }

    def setting(self) -> dict[str, Any]:
        return dict(self._SETTING)

    def load(self) -> None:
        if self.device.type != "cuda":
            raise MethodUnavailable("group offloading with a stream needs a CUDA device")
        try:
            from diffusers.hooks import apply_group_offloading
        except ImportError:
            raise MethodUnavailable("diffusers is not installed (pip install diffusers)") from None
        model = from_pretrained(self.prepared)
        apply_group_offloading(
            model, onload_device=self.device, offload_device=torch.device("cpu"), **self._SETTING
        )
        self.model = model

    def figures(self) -> Figures:
        # Every group (the blocks, and the modules outside them as one more) is copied in
        # at each forward from the pinned copy it keeps.
        total = self.prepared.total_bytes
        return Figures(total, {Link.H2D_PINNED: total * self.num_forwards}, stall_s=None)
