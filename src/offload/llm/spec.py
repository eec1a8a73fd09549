"""The model preamble with this machine's layout chooser: what `LLM`, `plan_for` and the
commands call to make their `ModelSpec` (`offload.model.spec`), once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from offload.model.spec import ModelSpec, make_model_spec
from offload.probes.layout_choice import LayoutChooser


def model_spec(model: str | Path | None, **settings: Any) -> ModelSpec:
    """`make_model_spec(model, **settings)` with each stored weight's layout measured
    here (`LayoutChooser`)."""
    return make_model_spec(model, layout_chooser=LayoutChooser, **settings)


__all__ = ["ModelSpec", "model_spec"]
