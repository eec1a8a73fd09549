"""The chooser of the layout each GGUF weight is kept in, as `model/` sees it. Choosing is
measuring this machine (`probes/layout_choice.LayoutChooser`, a layer above `model/`), so
the chooser is handed down by whoever builds the model; where the kernels are GGUF's own
blocks there is nothing to choose (`BlocksOnly`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from offload.quant.kinds import QuantLayout


class LayoutChoice(Protocol):
    """Chooses each weight's layout for the kernels it was made for, and keeps the seconds
    each choice was made on ("Q4_1 1536x576" -> layout -> seconds; empty where none was
    timed), which the converted folder's config records."""

    seconds: dict[str, dict[str, float]]

    def choose(self, name: str, raw: Any, kind: str) -> QuantLayout:
        """The layout of weight `name`, GGUF type `kind`, stored bytes `raw` [rows, bytes]."""
        ...


LayoutChoosers = Callable[[str], LayoutChoice]  # the kernels ("cpu", "cuda", "gguf") -> a chooser


class BlocksOnly:
    """The chooser for the kernels of GGUF's own blocks (`kernels="gguf"`): every weight
    stays in its blocks, which is the only layout those kernels have; nothing is timed."""

    def __init__(self) -> None:
        self.seconds: dict[str, dict[str, float]] = {}

    def choose(self, name: str, raw: Any, kind: str) -> QuantLayout:
        return QuantLayout.GGUF
