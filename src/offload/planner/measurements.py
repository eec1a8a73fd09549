"""What the planner is given about a machine: the `Measurements` of one model shape, dtype
and context length (bandwidths, and the compute of a decode step at each batch size), and
where they came from (`Measured`). `offload.probes` measures and caches them."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from offload.planner.cost import Rates


@dataclass
class Measurements:
    """What was measured (bandwidths in GB/s of 1e9 bytes; `layer_s` and `head_s` per
    entry of `batch_sizes`: one decoder layer, and the rest of a decode step)."""

    machine: str
    software: str
    device_type: str
    model_digest: str
    dtype: str
    context_len: int
    batch_sizes: list[int]
    layer_s: list[float]
    head_s: list[float]
    link_gb_per_s: float
    disk_gb_per_s: float
    uva_gb_per_s: float = 0.0
    disk_busy_gb_per_s: float = 0.0  # the disk read while the CPU computes (0: as alone)
    disk_source: str = ""
    notes: list[str] = field(default_factory=list)
    measured_at: str = ""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Measurements:
        """Parse `to_json`'s output; ValueError (naming the problem) for anything else."""
        data = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or set(data) - names:
            raise ValueError(f"measurements must be an object with keys {sorted(names)}")
        try:
            measured = cls(**data)
        except TypeError:  # a field missing
            raise ValueError(f"measurements must be an object with keys {sorted(names)}") from None
        if not len(measured.layer_s) == len(measured.batch_sizes) == len(measured.head_s):
            raise ValueError("layer_s and head_s need one entry per batch size")
        return measured

    def rates(self) -> Rates:
        return Rates(
            on_gpu=self.device_type == "cuda",
            link_gb_per_s=self.link_gb_per_s,
            disk_gb_per_s=self.disk_gb_per_s,
            uva_gb_per_s=self.uva_gb_per_s,
            disk_busy_gb_per_s=self.disk_busy_gb_per_s,
        )

    def compute_at(self, batch: int) -> tuple[float, float]:
        """(one layer, the rest of the step) in seconds at `batch`: measured, or linear
        between the measured batch sizes around it; beyond the largest, scaled with the
        batch (decode compute grows at most linearly with it); below the smallest, the
        smallest's."""
        sizes, figures = self.batch_sizes, list(zip(self.layer_s, self.head_s, strict=True))
        if batch in sizes:
            return figures[sizes.index(batch)]
        order = sorted(range(len(sizes)), key=sizes.__getitem__)
        below = [i for i in order if sizes[i] < batch]
        above = [i for i in order if sizes[i] > batch]
        if not below:
            return figures[above[0]]
        low = below[-1]
        if not above:
            scale = batch / sizes[low]
            return figures[low][0] * scale, figures[low][1] * scale
        high = above[0]
        share = (batch - sizes[low]) / (sizes[high] - sizes[low])
        return tuple(a + share * (b - a) for a, b in zip(figures[low], figures[high], strict=True))


class Measured(NamedTuple):
    measurements: Measurements
    path: Path  # the cache file
    from_cache: bool
