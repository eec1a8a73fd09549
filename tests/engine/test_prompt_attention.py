"""A prompt's attention on a CPU (`engine/prompt_attention`): each query's output is a
function of its own query and the columns it reads, bit for bit, however many other
queries share the call; close to ATen's attention; ATen's where the kernel does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.engine import prompt_attention
from offload.engine.prompt_attention import attention
from offload.quant import row_dot

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _kernels_built():
    if row_dot.library() is None:
        pytest.skip("no C compiler here: the kernels are not built")


def _qkv(tokens, heads=6, kv_heads=2, dim=64, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(1, h, tokens, dim, generator=generator).to(dtype)
        for h in (heads, kv_heads, kv_heads)
    )
    return q, k, v


def _causal_from(start: int, tokens: int, width: int) -> torch.Tensor:
    """The mask of queries at columns start.. reading every column up to their own."""
    return (torch.arange(width)[None, :] <= torch.arange(start, start + tokens)[:, None])[
        None, None
    ]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 80])
def test_close_to_aten(dtype, dim):
    q, k, v = _qkv(37, dim=dim, dtype=dtype)
    ours = attention(q, k, v, is_causal=True, enable_gqa=True)
    aten = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    assert ours.dtype == dtype and ours.shape == aten.shape
    torch.testing.assert_close(ours.float(), aten.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_position_has_the_same_bits_however_the_prompt_is_cut(dtype):
    tokens = 300  # (more than `_PIECE`: the mask read in pieces)
    q, k, v = _qkv(tokens, dtype=dtype)
    whole = attention(q, k, v, is_causal=True, enable_gqa=True)
    for start, end in [(256, 300), (16, 280), (299, 300), (0, 5)]:  # (after a held prefix, a chunk)
        mask = _causal_from(start, end - start, end)
        part = attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end], mask, enable_gqa=True)
        assert torch.equal(part, whole[:, :, start:end])
    # One token's heads packed as queries of their KV head (transformers' `pack_gqa`),
    # a float mask, and the KV heads repeated: the same bits.
    last = q[:, :, -1:].reshape(1, 2, 3, 64)
    packed = attention(last, k, v, torch.ones(1, 1, 1, tokens, dtype=torch.bool))
    assert torch.equal(packed.reshape(1, 6, 1, 64), whole[:, :, -1:])
    never = torch.finfo(dtype).min
    floats = torch.zeros(1, 1, tokens, tokens, dtype=dtype).masked_fill(
        ~_causal_from(0, tokens, tokens), never
    )
    repeated = attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), floats)
    assert torch.equal(repeated, whole)


@settings(max_examples=25, deadline=None)
@given(
    tokens=st.integers(1, 90),
    data=st.data(),
    kv_heads=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 2, 4]),
)
def test_each_query_is_its_own_whatever_shares_the_call(tokens, data, kv_heads, group):
    """Any run of queries, each reading any run of columns, gives each query the bits it
    has alone."""
    q, k, v = _qkv(tokens, heads=kv_heads * group, kv_heads=kv_heads, dim=32, seed=tokens)
    width = k.shape[2]
    lo = torch.tensor(
        data.draw(st.lists(st.integers(0, width - 1), min_size=tokens, max_size=tokens))
    )
    length = torch.tensor(
        data.draw(st.lists(st.integers(0, width), min_size=tokens, max_size=tokens))
    )
    hi = torch.minimum(lo + length, torch.tensor(width))
    columns = torch.arange(width)
    mask = ((columns >= lo[:, None]) & (columns < hi[:, None]))[None, None]
    together = attention(q, k, v, mask, enable_gqa=group > 1)
    for t in data.draw(st.lists(st.integers(0, tokens - 1), min_size=1, max_size=3)):
        alone = attention(q[:, :, t : t + 1], k, v, mask[:, :, t : t + 1], enable_gqa=group > 1)
        assert torch.equal(alone, together[:, :, t : t + 1])
        if hi[t] <= lo[t]:
            assert not alone.any()  # (a query that reads nothing: zeros, never NaN)


def test_what_the_kernel_does_not_take_goes_to_aten():
    q, k, v = _qkv(8)
    gaps = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    gaps[..., 3] = False  # (a query's columns not one run)
    bias = torch.full((1, 1, 8, 8), 0.5)  # (a float mask that is a bias)
    assert attention(q, k, v, gaps, enable_gqa=True) is None
    assert attention(q, k, v, bias, enable_gqa=True) is None
    assert attention(q, k, v, dropout_p=0.1, enable_gqa=True) is None
    assert attention(q, k, v) is None  # (6 query heads over 2 KV heads without enable_gqa)
    assert attention(q.double(), k.double(), v.double(), enable_gqa=True) is None
    with prompt_attention.PromptKernels():
        out = F.scaled_dot_product_attention(q, k, v, gaps, enable_gqa=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, gaps, enable_gqa=True))


def test_prompt_kernels_take_every_row_count():
    """In a prompt's forward, `F.linear` is the row-invariant product at any row count
    (MKL's rounds a row by how many share the call)."""
    weight = torch.randn(96, 128)
    x = torch.randn(200, 128)
    with prompt_attention.PromptKernels():
        whole = F.linear(x, weight)
        part = F.linear(x[150:153], weight)
    assert torch.equal(part, whole[150:153])
    assert torch.equal(whole, row_dot.row_linear(x, weight))


def test_a_forward_reads_its_mask_once_and_again_when_it_changes():
    """`PromptKernels` keeps the last mask's columns (every layer of a forward gets the same
    mask tensor); a mask changed in place, or another one, is read again."""
    q, k, v = _qkv(12)
    mask = _causal_from(0, 12, 12).clone()
    with prompt_attention.PromptKernels() as kernels:
        first = F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)
        assert [held for held, _ in kernels.known.values()] == [mask]
        F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)
        assert len(kernels.known) == 1  # (read once)
        mask[..., :4] = False  # (queries 0-3 now read nothing, the others from column 4)
        mask[..., 0:4, 0] = True
        second = F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)
        assert len(kernels.known) == 2  # (changed: read again)
    assert torch.equal(first, attention(q, k, v, _causal_from(0, 12, 12), enable_gqa=True))
    assert torch.equal(second, attention(q, k, v, mask, enable_gqa=True))
    assert not torch.equal(first[:, :, 4:], second[:, :, 4:])
