"""Attention of one new token as the compiled CPU step writes it (engine/step_attention.py):
which attention calls it takes, that it reads the keys before transformers repeats them,
and that it computes what the attention call did."""

import types

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from offload.engine.step_attention import rewrite_attention

HEADS, KV_HEADS, HEAD_SIZE = 6, 2, 16
LAYER = types.SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, is_causal=True)


def _compiled(function, graphs: list):
    """`function` compiled by dynamo alone, its graph rewritten (`rewrite_attention`) and
    run as Python; each graph's count of rewritten calls and its nodes' targets kept."""

    def backend(graph_module, example_inputs):
        count = rewrite_attention(graph_module.graph)
        targets = [node.target for node in graph_module.graph.nodes]
        graphs.append((count, targets))
        graph_module.recompile()
        return graph_module.forward

    return torch.compile(function, backend=backend, dynamic=False, fullgraph=True)


def _transformers_attention(query, keys, values, mask):
    """transformers' SDPA attention as a Llama layer calls it (keys of the KV heads)."""
    out, _ = sdpa_attention_forward(LAYER, query, keys, values, mask, scaling=0.25)
    return out


def _inputs(rows: int, width: int, query_positions: int = 1, bool_mask: bool = True):
    torch.manual_seed(0)
    query = torch.randn(rows, HEADS, query_positions, HEAD_SIZE) * 3
    keys = torch.randn(rows, KV_HEADS, width, HEAD_SIZE)
    values = torch.randn(rows, KV_HEADS, width, HEAD_SIZE)
    mask = torch.rand(rows, 1, query_positions, width) > 0.4
    mask[..., 0] = True  # (every row reads at least one column)
    if not bool_mask:
        mask = torch.where(mask, 0.0, -1e4)
    return query, keys, values, mask


@pytest.mark.parametrize(
    ("rows", "width", "bool_mask"), [(1, 7, True), (3, 40, True), (2, 33, False)]
)
def test_one_query_position_is_rewritten_and_computes_the_same(rows, width, bool_mask):
    inputs = _inputs(rows, width, bool_mask=bool_mask)
    graphs = []
    with torch.inference_mode():
        out = _compiled(_transformers_attention, graphs)(*inputs)
        expected = _transformers_attention(*inputs)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    [(count, targets)] = graphs
    assert count == 1
    assert F.scaled_dot_product_attention not in targets
    # The keys and values read as the KV heads hold them: transformers' repeat is gone.
    assert "expand" not in targets


def test_the_rewritten_attention_reads_each_row_s_own_columns():
    """A mask that differs by row (as the server's rows): a row's output must not change
    when another row's keys do."""
    query, keys, values, mask = _inputs(2, 16)
    graphs = []
    compiled = _compiled(_transformers_attention, graphs)
    with torch.inference_mode():
        first = compiled(query, keys, values, mask)
        keys[1] += 1.0
        values[1] -= 2.0
        second = compiled(query, keys, values, mask)
    assert torch.equal(first[0], second[0])
    assert not torch.equal(first[1], second[1])


def test_more_query_positions_or_a_causal_call_are_left_alone():
    graphs = []
    with torch.inference_mode():
        _compiled(_transformers_attention, graphs)(*_inputs(2, 8, query_positions=3))

        def causal(query, keys, values):
            return F.scaled_dot_product_attention(query, keys, values, is_causal=True)

        query, keys, values, _ = _inputs(1, 8)
        repeated = [t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (keys, values)]
        _compiled(causal, graphs)(query, *repeated)
    assert [count for count, _ in graphs] == [0, 0]


def test_keys_not_repeated_by_transformers_are_read_as_given():
    """Attention over as many KV heads as query heads (no repeat), no mask."""
    query, keys, values, _ = _inputs(2, 12)
    keys, values = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (keys, values))

    def plain(query, keys, values):  # (passed by name: read so too)
        return F.scaled_dot_product_attention(query=query, key=keys, value=values)

    graphs = []
    with torch.inference_mode():
        out = _compiled(plain, graphs)(query, keys, values)
        torch.testing.assert_close(out, plain(query, keys, values), rtol=1e-5, atol=1e-5)
    assert [count for count, _ in graphs] == [1]
