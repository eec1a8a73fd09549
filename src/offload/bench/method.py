"""A method is one way to run the workload's model: loaded once, then run batch after
batch, its counters read before and after each run."""

from __future__ import annotations

import contextlib
import gc
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from offload.bench.decode import Decoded, greedy_decode
from offload.bench.workload import Prepared
from offload.memory.placement import Link
from offload.planner.layouts import Layout
from offload.planner.shape import ModelShape


class MethodUnavailable(Exception):
    """The method cannot run here (no GPU, a package missing, the model does not fit);
    the message says why, and the bench goes on without it."""


@dataclass(frozen=True)
class Figures:
    """A method's counters so far: the bytes it keeps off the compute device, the bytes
    each link has moved (cumulative, by `bound.LINKS` name) and the time compute waited
    for them (None: the method does not say)."""

    offloaded_bytes: int = 0
    moved_bytes: Mapping[str, float] = field(default_factory=dict)
    stall_s: float | None = None


class Method(ABC):
    """`load()` once, `run(ids)` per batch (greedy decode, the same for every method),
    `figures()` before and after a run, `close()` at the end."""

    name: ClassVar[str]  # the --methods name
    label: ClassVar[str]  # what it is, for the report
    is_ours: ClassVar[bool] = False
    reads_disk = False  # reads its weights from the disk, around the page cache, each step
    reads_page_cache = False  # reads its weights from files through the page cache, each step

    def __init__(self, prepared: Prepared):
        self.prepared = prepared
        self.model: torch.nn.Module | None = None
        self.num_forwards = 0

    def setting(self) -> dict[str, Any]:
        """How the method is set up (a config or its arguments), as JSON."""
        return {}

    @abstractmethod
    def load(self) -> None:
        """Load the model with this method in place (raise MethodUnavailable to skip)."""

    def run(self, ids: torch.Tensor) -> Decoded:
        """Greedy decode of `ids` ([batch, prompt_len]) for the workload's output length."""
        assert self.model is not None, f"{self.name}: run() before load()"
        decoded = greedy_decode(self.model, ids, self.prepared.workload.output_len, self.device)
        self.num_forwards += decoded.num_forwards
        return decoded

    @abstractmethod
    def figures(self) -> Figures: ...

    def layout(self, shape: ModelShape) -> Layout | None:
        """The planner's layout of this method (None: not one the planner knows), for
        its prediction of the step."""
        return None

    def close(self) -> None:
        self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def device(self) -> torch.device:
        return self.prepared.device

    @property
    def copy_link(self) -> str:
        """The link a copy to the compute device crosses: on a CPU, a copy in host memory."""
        return Link.H2D_PINNED if self.device.type == "cuda" else Link.MEMCPY


def from_pretrained(prepared: Prepared, **kwargs: Any) -> torch.nn.Module:
    """transformers' own load of the checkpoint in the workload's dtype (its built-in
    classes only: a checkpoint's own code never runs)."""
    from transformers import AutoModelForCausalLM

    if prepared.workload.quantization is not None:
        raise MethodUnavailable(
            "transformers' from_pretrained reads no offload folder of weights as stored "
            "(run the peers without --quantization)"
        )
    with _quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(
            prepared.path, dtype=prepared.dtype, trust_remote_code=False, **kwargs
        )
    return model.eval()


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No per-load progress bar from transformers (the bench draws its own)."""
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


def module_bytes_by_place(model: torch.nn.Module, places: Mapping[str, Any]) -> dict[str, int]:
    """Parameter bytes by where a device map (`hf_device_map`: module name -> place) puts
    them; each parameter goes with the longest module name that holds it."""
    found: dict[str, int] = {}
    for name, param in model.named_parameters():
        owners = [m for m in places if m == "" or name == m or name.startswith(m + ".")]
        place = str(places[max(owners, key=len)]) if owners else "unmapped"
        found[place] = found.get(place, 0) + param.numel() * param.element_size()
    return found
