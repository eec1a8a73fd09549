"""What the planner is given about a machine: the `Measurements` of one model shape, dtype
and context length (bandwidths, and the compute of a decode step at each batch size), and
where they came from (`Measured`). `offload.probes` measures and caches them."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from offload.planner.cost import Rates

# What a measurement can be: no link or disk reaches 100 TB/s, no decode step of one
# layer takes a day, and none is faster than 0.1 microseconds (a kernel launch is more).
_MAX_GB_PER_S = 1e5
_MAX_STEP_S = 86400.0
_MIN_LAYER_S = 1e-7


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
        lists = (measured.layer_s, measured.batch_sizes, measured.head_s)
        if not all(isinstance(values, list) for values in lists):
            raise ValueError("batch_sizes, layer_s and head_s must be lists")
        if not len(measured.layer_s) == len(measured.batch_sizes) == len(measured.head_s):
            raise ValueError("layer_s and head_s need one entry per batch size")
        measured._check_values()
        return measured

    def _check_values(self) -> None:
        """Types and ranges a measurement can have (a file edited or damaged by hand is
        refused, not planned with)."""
        for name in ("machine", "software", "device_type", "model_digest", "dtype"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string")
        if not isinstance(self.notes, list) or not all(isinstance(n, str) for n in self.notes):
            raise ValueError("notes must be a list of strings")
        for name, values in (
            ("context_len", [self.context_len]),
            ("batch_sizes", self.batch_sizes),
        ):
            if not values or not all(_is_int(v) and v >= 1 for v in values):
                raise ValueError(f"{name} must hold integers >= 1")
        rates = [self.link_gb_per_s, self.disk_gb_per_s, self.uva_gb_per_s]
        rates.append(self.disk_busy_gb_per_s)
        if not all(_is_number(v) and 0 <= v < _MAX_GB_PER_S for v in rates):
            raise ValueError(f"bandwidths must be numbers in [0, {_MAX_GB_PER_S}) GB/s")
        times = [*self.layer_s, *self.head_s]
        if not all(_is_number(v) and 0 <= v < _MAX_STEP_S for v in times):
            raise ValueError(f"layer_s and head_s must be numbers in [0, {_MAX_STEP_S}) s")
        if any(0 < v < _MIN_LAYER_S for v in self.layer_s):
            raise ValueError(f"a decoder layer cannot take less than {_MIN_LAYER_S} s")

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
