"""What a converted .gguf's config.json says of its quantized weights
(`quantization_config` of method gguf): each weight's GGUF type, its layout, and the
weights kept in llama.cpp's row order; read and checked before a model is built (and
cut to a model's first layers, for packed checkpoints' forms too)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from offload.errors import ModelError
from offload.quant.gguf_quants import FORMATS
from offload.quant.kinds import QuantLayout
from offload.quant.packed_modules import FORMS_KEY
from offload.quant.quantized import ROW_ORDERS_KEY
from offload.quant.traits import LAYOUTS


def weight_types(settings: Mapping[str, Any], where: object) -> dict[str, str]:
    """The GGUF type of each quantized weight named by config.json (ModelError if any is
    not one that is read)."""
    types = settings.get("weight_types")
    if not isinstance(types, dict) or not all(isinstance(k, str) for k in types):
        raise ModelError(f"{where}: quantization_config of method gguf needs weight_types")
    for name, kind in types.items():
        if kind not in FORMATS:
            raise ModelError(
                f"{where}: {name} is of GGUF type {kind!r}; read: {', '.join(FORMATS)}"
            )
    return dict(types)


def weight_layouts(settings: Mapping[str, Any], where: object) -> dict[str, str]:
    """The layout each quantized weight is kept in (`quant/layouts.py`; "gguf" when not
    named). An int4 layout made by another torch or CPU is refused: its packing differs."""
    layouts = settings.get("weight_layouts") or {}
    if not isinstance(layouts, dict) or set(layouts.values()) - set(QuantLayout):
        *most, last = QuantLayout
        raise ModelError(f"{where}: weight_layouts must map names to {', '.join(most)} or {last}")
    for layout, traits in LAYOUTS.items():
        packing = traits.packing
        if packing is None or layout not in layouts.values():
            continue
        if settings.get(packing.settings_key) != packing.here():
            raise ModelError(
                f"{where}: its 4-bit weights are packed for {settings.get(packing.settings_key)}, "
                f"this {packing.made_by} pack them as {packing.here()}; convert the .gguf again"
            )
    return dict(layouts)


def row_orders(settings: Mapping[str, Any], where: object) -> dict[str, int]:
    """The weights config.json names as kept in llama.cpp's row order, and their heads."""
    orders = settings.get(ROW_ORDERS_KEY) or {}
    if not isinstance(orders, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in orders.values()
    ):
        raise ModelError(f"{where}: {ROW_ORDERS_KEY} must map weight names to heads (>0)")
    return dict(orders)


def first_layers_only(quantization: dict[str, Any], count: int) -> None:
    """Keep in a `quantization_config` only the weights of the first `count` layers (and
    those outside the layer stack): the config of a model cut to `count` layers names no
    weight it lacks."""
    for key in ("weight_types", "weight_layouts", ROW_ORDERS_KEY, FORMS_KEY):
        if isinstance(quantization.get(key), dict):
            quantization[key] = {
                name: kind
                for name, kind in quantization[key].items()
                if (index := _layer_index(name)) is None or index < count
            }


def _layer_index(name: str) -> int | None:
    """The index of the layer a weight is in ("model.layers.3.mlp.up_proj": 3), if any."""
    found = re.search(r"\.(\d+)\.", f".{name}.")
    return int(found.group(1)) if found else None
