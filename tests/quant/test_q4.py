"""The q4 layout and its integer products (`quant/row_q4.c`, `row_dot.q4_linear`), and the
q8 block columns' products on the same integers (`row_dot.q8_linear`, blocks of 32): the
file's 4-bit values and scales kept exactly; each output the same bits whatever the rows
beside it, the thread count, or the vector path; close to float64's product of the
de-quantized weight (inputs rounded to 15 bits a group, not 8 as bfloat16 keeps)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from offload.model.default import gguf_path
from offload.model.gguf_fast import FastReader
from offload.quant import kernels, row_dot
from offload.quant.gguf_quants import FORMATS, dequantize
from offload.quant.layouts import pack_q8, q4_tensors, q4_values

ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 33, 64, 70)

pytestmark = pytest.mark.skipif(row_dot.library() is None, reason="no C compiler here")


@pytest.fixture(scope="module")
def file_rows():
    """Two of the default model's Q4_1 weights as the file holds them (uint8 rows)."""
    tensors = {t.name: t for t in FastReader(gguf_path()).tensors}
    return {
        name: torch.from_numpy(np.array(tensors[name].data))
        for name in ("blk.0.ffn_down.weight", "blk.2.ffn_up.weight", "token_embd.weight")
    }


def _rows(count: int, width: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(count, width, generator=torch.Generator().manual_seed(seed))


def _random_blocks(kind: str, rows: int, blocks: int) -> torch.Tensor:
    """Random rows of `kind` whose leading float16 scales (and Q4_1's minimums) are small
    and finite, as a quantizer writes them."""
    block = FORMATS[kind]
    rng = np.random.default_rng(0)
    raw = torch.from_numpy(rng.integers(0, 256, (rows, blocks * block.block_bytes), dtype=np.uint8))
    scales = torch.from_numpy(rng.uniform(1e-3, 2e-2, (rows, blocks, 2)).astype(np.float16))
    for b in range(blocks):
        raw[:, b * block.block_bytes : b * block.block_bytes + 4] = scales[:, b].view(torch.uint8)
    return raw


@pytest.mark.parametrize("name", ["blk.0.ffn_down.weight", "blk.2.ffn_up.weight"])
def test_a_row_gets_the_same_bits_alone_among_any_rows_and_on_any_thread_count(file_rows, name):
    raw = file_rows[name][:200]  # (200 outputs: the last 16 of them a part tile)
    _check_rows_own(row_dot.q4_linear, q4_tensors(raw, "Q4_1"), dequantize(raw, "Q4_1"))


@pytest.mark.skipif(not row_dot.q4_fast(), reason="no AVX-512 VNNI: q8 keeps float sums")
@pytest.mark.parametrize("kind", ["Q8_0", "Q5_1"])
def test_a_q8_products_integers_are_its_rows_own_on_any_thread_count(file_rows, kind):
    """The default model's Q8_0 head rows (and random Q5_1 ones, which have offsets) on
    the same integer sums."""
    head = file_rows["token_embd.weight"][:200]  # (200 outputs: the last 8 a part tile)
    raw = head if kind == "Q8_0" else _random_blocks(kind, 200, 18)
    _check_rows_own(row_dot.q8_linear, pack_q8(raw, kind), dequantize(raw, kind))


def _check_rows_own(product, weight, floats):
    """`product`'s rows: close to float64's product with `floats`, each row's bits alone,
    among any rows, on one thread or two, and one output at a time (a CPU without VNNI)."""
    rows = _rows(max(ROW_COUNTS), floats.shape[1])
    every = product(rows, *weight)
    exact = rows.double() @ floats.double().T
    assert ((every.double() - exact).norm() / exact.norm()) < 2e-4  # (measured 4e-5)
    for count in ROW_COUNTS:
        assert torch.equal(product(rows[:count], *weight), every[:count]), count
    for index in (0, 5, 69):
        assert torch.equal(product(rows[index : index + 1], *weight), every[index : index + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(product(rows, *weight), every)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(product(rows[:9], *weight, plain=True), every[:9])


def test_bfloat16_rows_are_multiplied_in_float32(file_rows):
    weight = q4_tensors(file_rows["blk.2.ffn_up.weight"][:64], "Q4_1")
    rows = _rows(3, 576).bfloat16()
    out = row_dot.q4_linear(rows, *weight)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, row_dot.q4_linear(rows.float(), *weight).bfloat16())


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_the_layout_keeps_each_types_values(kind):
    """The values as laid out are the file's: bitwise where the reference computes
    `scale * q + offset` (Q4_1, Q4_K), within a rounding for Q4_0's `d * (q - 8)`."""
    blocks = 256 // FORMATS[kind].block_size * 2 if kind == "Q4_K" else 4
    raw = _random_blocks(kind, 40, blocks)
    nibbles, scales, offsets = q4_tensors(raw, kind)
    assert nibbles.shape == (
        3,
        raw.shape[1] // FORMATS[kind].block_bytes * FORMATS[kind].block_size // 32,
        256,
    )
    assert scales.dtype == (torch.float32 if kind == "Q4_K" else torch.float16)
    values, reference = q4_values(nibbles, scales, offsets), dequantize(raw, kind)
    if kind == "Q4_0":
        assert torch.allclose(values, reference, rtol=1e-6, atol=1e-7)
    else:
        assert torch.equal(values, reference)


def test_a_weight_that_does_not_take_the_rows_is_refused(file_rows):
    weight = q4_tensors(file_rows["blk.2.ffn_up.weight"][:32], "Q4_1")
    with pytest.raises(ValueError, match="does not take"):
        row_dot.q4_linear(_rows(2, 544), *weight)
    with pytest.raises(ValueError, match="does not take"):
        row_dot.q4_linear(_rows(2, 576), weight[0], weight[1], weight[2].float())


def test_without_the_library_a_q4_weight_multiplies_its_float_values(file_rows, monkeypatch):
    """A folder laid out where the kernels were built, read where they are not (no
    compiler, OFFLOAD_ROW_DOT=0): `F.linear` of the weight's float32 values."""
    raw = file_rows["blk.2.ffn_up.weight"][:48]
    weight = q4_tensors(raw, "Q4_1")
    rows = _rows(5, 576)
    monkeypatch.setattr(row_dot, "library", lambda: None)
    out = kernels.q4_matmul(rows, *weight)
    assert torch.equal(out, torch.nn.functional.linear(rows, dequantize(raw, "Q4_1")))
