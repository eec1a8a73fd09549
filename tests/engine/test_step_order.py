"""The compiled CPU step keeps the eager step's bits (engine/step_order.py): each sum and
library function of dynamo's graph runs ATen's kernel, attention in the form transformers
calls it eagerly, and inductor rounds elementwise results as eager does."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from compiling import graphs_compiled_anew
from torch._dynamo.utils import counters
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from offload.engine import compile_options, invariant, step_order

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

HEADS, KV_HEADS, WIDTH, COLUMNS = 6, 2, 32, 40


def _decoder_parts(x, weight, inv_freq, positions, query, keys, values, mask):
    """The order-sensitive parts of a decoder layer's step of one token a row, as
    transformers writes them: an RMS norm, the rotary embedding, activations, a layer norm,
    a softmax and attention of grouped query heads (`sdpa_attention_forward`)."""
    dtype = x.dtype
    h = x.float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype) * weight
    freqs = (inv_freq[None, :, None].float() @ positions[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    act = F.silu(h) * h + F.gelu(h) + F.gelu(h, approximate="tanh") + torch.tanh(h) * 0.5
    act = act + torch.erf(h) + torch.exp(-h.abs()) + torch.log1p(h.abs()) + h.pow(3) * 0.01
    normed = F.layer_norm(act, act.shape[-1:], weight, None, 1e-5)
    probs = torch.softmax(normed.float(), dim=-1)
    module = types.SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, is_causal=True)
    attended, _ = sdpa_attention_forward(
        module, query * cos[:, None], keys, values, mask, scaling=0.17
    )
    return h, cos, sin, act, normed, probs, attended


def _inputs(dtype: torch.dtype, rows: int = 3) -> tuple:
    generator = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    mask = torch.zeros(rows, 1, 1, COLUMNS, dtype=torch.bool)
    for row in range(rows):
        mask[row, ..., : COLUMNS - 7 * row] = True  # (each row reads its own columns)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, WIDTH, 2).float() / WIDTH))
    positions = torch.tensor([[17], [301], [4095]][:rows])
    return (randn(rows, 1, WIDTH, scale=3.0), randn(WIDTH), inv_freq, positions,
            randn(rows, HEADS, 1, WIDTH), randn(rows, KV_HEADS, COLUMNS, WIDTH),
            randn(rows, KV_HEADS, COLUMNS, WIDTH), mask)  # fmt: skip


def _compiled(function, options):
    """`function` compiled at its first call, missing the caches of whole graphs (so that
    the pass runs, counted), after dynamo's reset (which clears its counters)."""
    torch._dynamo.reset()
    compiled = torch.compile(function, dynamic=False, options=options)

    def call(*args):
        with graphs_compiled_anew():
            return compiled(*args)

    return call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_compiled_steps_norms_activations_and_attention_keep_the_eager_bits(dtype):
    inputs = _inputs(dtype)
    compiled_parts = _compiled(_decoder_parts, compile_options.COMPILE_OPTIONS)
    before = counters["offload"]["eager_order"]
    with torch.inference_mode():
        with invariant.StepAttention(apart=True):  # (as an eager decode step runs on a CPU)
            eager = _decoder_parts(*inputs)
        compiled = compiled_parts(*inputs)
    assert counters["offload"]["eager_order"] - before >= 10  # (the pass ran)
    for name, mine, theirs in zip(("norm", "cos", "sin", "act", "layer norm", "softmax",
                                   "attention"), compiled, eager, strict=True):  # fmt: skip
        assert torch.equal(mine, theirs), name


def test_without_the_pass_inductor_gives_other_float32_bits():
    """What the pass is for (and that the test above can tell): inductor's own sums and
    library functions part from ATen's in the last bits."""
    inputs = _inputs(torch.float32)
    options = {**compile_options.COMPILE_OPTIONS, "pre_grad_custom_pass": None}
    with torch.inference_mode():
        eager = _decoder_parts(*inputs)
        compiled = _compiled(_decoder_parts, options)(*inputs)
    parted = [torch.equal(mine, theirs) for mine, theirs in zip(compiled, eager, strict=True)]
    assert not all(parted)


def test_calls_the_pass_cannot_write_as_eager_are_left_to_inductor():
    """Attention with dropout stays as it was; a mean over the last dim is replaced."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = torch.empty(2, 3, 1, 8)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["example_value"] = fake
    dropped = graph.call_function(F.scaled_dot_product_attention, (x, x, x), {"dropout_p": 0.5})
    mean = graph.call_method("mean", (dropped, -1), {"keepdim": True})
    with mode:
        dropped.meta["example_value"] = torch.empty(2, 3, 1, 8)
        mean.meta["example_value"] = torch.empty(2, 3, 1, 1)
    graph.output(mean)
    assert step_order.eager_order(graph) == 1
    targets = [node.target for node in graph.nodes if node.op == "call_function"]
    assert targets == [F.scaled_dot_product_attention, torch.ops.offload.eager_reduce.default]
