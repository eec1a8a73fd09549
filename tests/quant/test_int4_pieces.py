"""The CPU's int4 layout is made in pieces of rows (a large weight's widened copies would
otherwise take 8x its stored bytes): the pieces give the bytes of packing it whole."""

from __future__ import annotations

import pytest
import torch

from offload.quant import layouts
from offload.quant.layouts import int4_cpu_layout
from offload.quant.traits import laid_out

pytestmark = pytest.mark.skipif(int4_cpu_layout() is None, reason="no CPU int4 kernel here")


def _q4_0_rows(rows: int, columns: int) -> torch.Tensor:
    """Random Q4_0 rows (uint8 [rows, bytes]) with finite scales."""
    generator = torch.Generator().manual_seed(rows)
    blocks = rows * columns // 32
    scale = (torch.rand(blocks, 1, generator=generator) / 50).to(torch.float16)
    nibbles = torch.randint(0, 256, (blocks, 16), generator=generator, dtype=torch.uint8)
    return torch.cat([scale.view(torch.uint8), nibbles], dim=1).reshape(rows, -1)


@pytest.mark.parametrize("rows", [64, 2 * 1024 + 64 + 48])  # one piece; two, a part, a tail
def test_the_int4_layout_in_pieces_is_the_whole_packing(rows):
    raw = _q4_0_rows(rows, 256)
    whole_packed, whole_scale_zero = layouts._int4(raw, "Q4_0", None)
    tensors = laid_out("w.weight", raw, "Q4_0", "int4")
    assert torch.equal(tensors["w.weight"], whole_packed)
    assert torch.equal(tensors["w.scale_zero"], whole_scale_zero.contiguous())
