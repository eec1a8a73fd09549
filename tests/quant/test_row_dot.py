"""The row-invariant products (`quant/row_dot`): each output the same bits whatever the
rows beside it, the thread count or the tile it falls in; close to float64's product; the
library kept only signed in the user's cache, and not used where it is switched off."""

from __future__ import annotations

import pytest
import torch

from offload.memory import cache_digest
from offload.quant import row_dot

ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 33, 64, 70)


def _weight(shape, dtype, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1536, 64), (13, 37), (70, 200)])
def test_a_row_gets_the_same_bits_alone_and_among_any_rows(dtype, shape):
    weight = _weight(shape, dtype)
    rows = _weight((max(ROW_COUNTS), shape[1]), dtype, seed=1)
    every = row_dot.row_linear(rows, weight)
    exact = rows.double() @ weight.double().T
    assert every.dtype == dtype
    assert torch.allclose(
        every.double(), exact, rtol=2e-2 if dtype != torch.float32 else 1e-4, atol=1e-2
    )
    for count in ROW_COUNTS:
        assert torch.equal(row_dot.row_linear(rows[:count], weight), every[:count]), count
    for index in (0, 5, 69):  # a row alone, wherever it stood
        assert torch.equal(
            row_dot.row_linear(rows[index : index + 1], weight), every[index : index + 1]
        )


@pytest.mark.skipif(not row_dot.bf16_dot(), reason="this CPU has no AVX512-BF16")
@pytest.mark.parametrize("shape", [(70, 200), (9, 2048)])
def test_bfloat16_pairs_give_the_widened_kernels_bits(shape):
    # vdpbf16ps adds a pair's odd product, then its even one, each rounded once: the widened
    # kernel's two fmas in that order (float32 rows of the same values take it)
    weight = _weight(shape, torch.bfloat16, seed=5)
    rows = _weight((max(ROW_COUNTS), shape[1]), torch.bfloat16, seed=6)
    lib, n, k = row_dot.library(), *shape
    pairs, widened = torch.empty(len(rows), n), torch.empty(len(rows), n)
    wide_rows = rows.float().contiguous()
    assert not lib.rowdot_bf16x(rows.data_ptr(), len(rows), weight.data_ptr(), n, k, k,
                                pairs.data_ptr(), 2)  # fmt: skip
    assert not lib.rowdot_bf16(wide_rows.data_ptr(), len(rows), weight.data_ptr(), n, k, k,
                               widened.data_ptr(), 2)  # fmt: skip
    assert torch.equal(pairs, widened)
    assert torch.equal(row_dot.row_linear(rows, weight), pairs.to(torch.bfloat16))


def test_the_thread_count_changes_no_bit():
    weight, rows = _weight((257, 96), torch.float32), _weight((9, 96), torch.float32, seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = row_dot.row_linear(rows, weight)
        torch.set_num_threads(max(threads, 2))
        assert torch.equal(row_dot.row_linear(rows, weight), one)
    finally:
        torch.set_num_threads(threads)


def _q8(blocks, outs, group, offsets, scale_dtype):
    generator = torch.Generator().manual_seed(3)
    values = torch.randint(-127, 128, (blocks, outs, group), dtype=torch.int8, generator=generator)
    scales = (torch.rand(blocks, outs, generator=generator) / 64).to(scale_dtype)
    extra = (
        (torch.rand(blocks, outs, generator=generator) / 64).to(scale_dtype) if offsets else None
    )
    return values, scales, extra


@pytest.mark.parametrize(
    ("group", "offsets", "scale_dtype"),
    [(32, False, torch.float16), (32, True, torch.float16), (16, True, torch.float32)],
)
def test_a_q8_product_is_the_same_alone_and_among_any_rows(group, offsets, scale_dtype):
    blocks, outs = 5, 70
    values, scales, extra = _q8(blocks, outs, group, offsets, scale_dtype)
    rows = _weight((130, blocks * group), torch.float32, seed=4)  # (past 64: in pieces)
    every = row_dot.q8_linear(rows, values, scales, extra)
    weight = (values.double() * scales.double()[..., None]).permute(1, 0, 2)  # [out, blocks, g]
    exact = rows.double().view(len(rows), blocks, group).flatten(1) @ weight.flatten(1).T
    if extra is not None:
        exact += rows.double().view(len(rows), blocks, group).sum(-1) @ extra.double()
    # (blocks of 32 on a VNNI CPU: integer sums of inputs rounded to 15 bits, ~4e-5)
    assert ((every.double() - exact).norm() / exact.norm()) < 2e-4
    for count in ROW_COUNTS:
        assert torch.equal(row_dot.q8_linear(rows[:count], values, scales, extra), every[:count])
    assert torch.equal(row_dot.q8_linear(rows[100:101], values, scales, extra), every[100:101])


def test_the_library_is_kept_signed_and_a_changed_copy_is_built_again(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    data = row_dot._built()
    (kept,) = (tmp_path / "cache" / "kernels").glob("row_dot-*.so")
    assert cache_digest.read_signed(kept) == data
    kept.write_bytes(b"\x7fELF planted")  # not what the cache signed: never loaded
    assert row_dot._built() == data
    assert cache_digest.read_signed(kept) == data


def test_switched_off_the_products_are_not_used(monkeypatch):
    monkeypatch.setenv(row_dot.ENV, "0")
    row_dot.library.cache_clear()
    try:
        assert row_dot.library() is None
        assert not row_dot.fits(torch.ones(1, 4), torch.ones(3, 4))
    finally:
        monkeypatch.delenv(row_dot.ENV)
        row_dot.library.cache_clear()
    assert row_dot.library() is not None
