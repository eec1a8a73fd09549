"""Attention of one new token, as the compiled CPU decode step writes it: a product with
the keys, a softmax and a product with the values, each KV head's query heads together.

Traced, transformers' attention repeats each KV head's keys and values for its query heads
(`repeat_kv`: a copy of the cache read, every layer and step) and calls ATen's attention
kernel on the copies, an opaque call that splits the step's fusions. Written out instead,
inductor reads each cached key and value once from its generated loops, with the rest of
the layer around them. One layer of the default model (9 query heads over 3 KV heads,
head size 64), compiled, ran faster so at every number of rows and columns timed
(docs/benchmarks.md, "2026-11-28 (twentieth session): attention written out in the
compiled step; the server's lone row compiled (issue 28)").

Every offloaded form of a step runs this same graph, so they keep the resident step's bits.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch._inductor import inductor_prims

_FULL = slice(None, None, None)
# The dtypes of attention it writes out; bfloat16 and float16 are computed in float32
# (their loads upcast in registers), as ATen's CPU attention kernel computes them.
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class Emitter:
    """Adds nodes to a dynamo graph before a node, each with its fake value computed (as
    dynamo leaves them for inductor's passes)."""

    def __init__(self, graph: torch.fx.Graph, fake_mode):
        self._graph = graph
        self._fake_mode = fake_mode

    def __call__(self, function, *args) -> torch.fx.Node:
        fakes = [
            arg.meta["example_value"] if isinstance(arg, torch.fx.Node) else arg for arg in args
        ]
        node = self._graph.call_function(function, args)
        with self._fake_mode:
            node.meta["example_value"] = function(*fakes)
        return node


def rewrite_attention(graph: torch.fx.Graph) -> int:
    """Rewrite each CPU `scaled_dot_product_attention` of one query position in dynamo's
    graph as `_emit` writes it; the number rewritten."""
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not F.scaled_dot_product_attention:
            continue
        parts = _parts(node)
        if parts is None:
            continue
        query = parts[0]
        with graph.inserting_before(node):
            out = _emit(Emitter(graph, query.meta["example_value"].fake_mode), *parts)
        node.replace_all_uses_with(out)
        given = _arguments(node)
        graph.erase_node(node)
        for tensor in (given["key"], given["value"]):
            _erase_unused(graph, tensor)
        rewritten += 1
    graph.lint()
    return rewritten


def _parts(node: torch.fx.Node) -> tuple | None:
    """(query, keys, values, mask, scale) of an attention node to rewrite, the keys and
    values before transformers repeated them; None where it is not one (more than one
    query position, dropout, a causal flag, a per-head mask, not a float dtype of
    `FLOATS` on a CPU)."""
    given = _arguments(node)
    query, key, value = given.get("query"), given.get("key"), given.get("value")
    if not all(isinstance(x, torch.fx.Node) for x in (query, key, value)):
        return None
    if given.get("dropout_p", 0.0) != 0.0 or given.get("is_causal", False):
        return None
    q = query.meta.get("example_value")
    if q is None or q.dim() != 4 or q.shape[2] != 1 or q.device.type != "cpu":
        return None
    if q.dtype not in FLOATS:
        return None
    mask = given.get("attn_mask")
    if mask is not None:
        m = mask.meta.get("example_value") if isinstance(mask, torch.fx.Node) else None
        if m is None or m.dim() != 4 or m.shape[1] != 1 or m.shape[2] != 1:
            return None
    keys, values = _unrepeated(key), _unrepeated(value)
    heads = q.shape[1]
    if not given.get("enable_gqa", False) and (_heads(keys) != _heads(values)):
        keys, values = key, value  # (repeated differently: read them as given)
    if heads % _heads(keys):
        return None
    scale = given.get("scale")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return query, keys, values, mask, scale


def _arguments(node: torch.fx.Node) -> dict:
    """An attention call's arguments by name, however they were passed."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    return dict(zip(names, node.args, strict=False)) | dict(node.kwargs)


def _heads(node: torch.fx.Node) -> int:
    return node.meta["example_value"].shape[1]


def _unrepeated(node: torch.fx.Node) -> torch.fx.Node:
    """The keys (or values) `node` repeats per query head, as transformers' `repeat_kv`
    does (`x[:, :, None].expand(b, kv, groups, n, d).reshape(b, kv * groups, n, d)`);
    `node` itself where it is not that."""
    if not _is_method(node, "reshape"):
        return node
    expanded = node.args[0]
    if not isinstance(expanded, torch.fx.Node) or not _is_method(expanded, "expand"):
        return node
    indexed = expanded.args[0]
    if not isinstance(indexed, torch.fx.Node) or indexed.target is not operator.getitem:
        return node
    base, index = indexed.args
    if index != (_FULL, _FULL, None, _FULL, _FULL) or not isinstance(base, torch.fx.Node):
        return node
    if base.meta.get("example_value") is None or base.meta["example_value"].dim() != 4:
        return node
    return base


def _is_method(node: torch.fx.Node, name: str) -> bool:
    if node.op == "call_method":
        return node.target == name
    return node.op == "call_function" and node.target is getattr(torch.Tensor, name)


def _emit(emit: Emitter, query, keys, values, mask, scale: float) -> torch.fx.Node:
    """softmax(q k^T * scale, masked) v for queries [b, heads, 1, d] over keys and values
    [b, kv_heads, n, d]: the query heads of each KV head as one group; in float32, the
    result in the query's dtype."""
    q, k = query.meta["example_value"], keys.meta["example_value"]
    heads, kv_heads, width = q.shape[1], k.shape[1], q.shape[-1]
    v_width = values.meta["example_value"].shape[-1]
    if q.dtype != torch.float32:  # (each cached value upcast where its loop loads it)
        query, keys, values = (emit(torch.Tensor.float, x) for x in (query, keys, values))
    grouped = emit(torch.reshape, query, (-1, kv_heads, heads // kv_heads, 1, width))
    # The queries in a buffer of their own: else inductor computes each where it is read,
    # its rotary embedding (cos, sin) again for every column of keys.
    grouped = emit(
        inductor_prims.force_stride_order,
        grouped,
        (heads * width, heads // kv_heads * width, width, width, 1),
    )
    products = emit(torch.mul, grouped, emit(torch.unsqueeze, keys, 2))  # [b, kv, g, n, d]
    scores = emit(torch.mul, emit(torch.sum, products, -1), scale)  # [b, kv, g, n]
    if mask is not None:  # [b, 1, 1, n]
        if mask.meta["example_value"].dtype == torch.bool:
            scores = emit(torch.where, mask, scores, float("-inf"))
        else:
            scores = emit(torch.add, scores, mask)
    weights = emit(torch.softmax, scores, -1)
    weighted = emit(torch.mul, emit(torch.unsqueeze, weights, -1), emit(torch.unsqueeze, values, 2))
    out = emit(torch.sum, weighted, -2)  # [b, kv, g, d]
    out = emit(torch.reshape, out, (-1, heads, 1, v_width))
    return out if q.dtype == torch.float32 else emit(torch.Tensor.to, out, q.dtype)


def _erase_unused(graph: torch.fx.Graph, node) -> None:
    """Erase the views of `repeat_kv` (`_unrepeated`) that nothing uses any more."""
    for is_view in (_reshaped, _expanded, _indexed):
        if not isinstance(node, torch.fx.Node) or node.users or not is_view(node):
            return
        source = node.args[0]
        graph.erase_node(node)
        node = source


def _reshaped(node: torch.fx.Node) -> bool:
    return _is_method(node, "reshape")


def _expanded(node: torch.fx.Node) -> bool:
    return _is_method(node, "expand")


def _indexed(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem
