"""The layouts' table: what a layout's tensors will be is known before they are made."""

from __future__ import annotations

import numpy as np
import torch

from offload.quant.gguf_quants import EIGHT_BIT_GROUPS, FORMATS
from offload.quant.layouts import INT4_TYPES, int4_cpu_layout
from offload.quant.traits import laid_out, stored_entries


def test_each_layouts_tensors_are_known_before_it_is_made():
    """The header is written first: `stored_entries` must name what `laid_out` makes."""
    rng = np.random.default_rng(0)
    for kind, block in FORMATS.items():
        raw = torch.from_numpy(rng.integers(0, 256, (16, 2 * block.block_bytes), dtype=np.uint8))
        for at in (0, block.block_bytes):  # (finite scales where they lead each block)
            raw[:, at:].view(torch.float16)[..., 0] = 0.01
        layouts = ["gguf"] + ["q8"] * (kind in EIGHT_BIT_GROUPS)
        layouts += ["int4"] * (kind in INT4_TYPES and int4_cpu_layout() is not None)
        layouts += ["q4"] * (kind in INT4_TYPES)  # (laid out anywhere; run fast with VNNI)
        for layout in layouts:
            made = laid_out("w.weight", raw, kind, layout)
            expected = [(k, t.dtype, tuple(t.shape)) for k, t in made.items()]
            assert stored_entries("w.weight", kind, raw.shape, layout) == expected, (kind, layout)
