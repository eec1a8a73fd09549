"""Edits of a dynamo graph before inductor lowers it (the compiled CPU step's passes:
`step_linears`, `step_order`): nodes added with their fake values, and transformers'
`repeat_kv` found and taken apart."""

from __future__ import annotations

import operator

import torch

_FULL = slice(None, None, None)


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


def unrepeated(node: torch.fx.Node) -> torch.fx.Node:
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


def erase_unused(graph: torch.fx.Graph, node) -> None:
    """Erase the views of `repeat_kv` (`unrepeated`) that nothing uses any more."""
    for is_view in (_reshaped, _expanded, _indexed):
        if not isinstance(node, torch.fx.Node) or node.users or not is_view(node):
            return
        source = node.args[0]
        graph.erase_node(node)
        node = source


def _is_method(node: torch.fx.Node, name: str) -> bool:
    if node.op == "call_method":
        return node.target == name
    return node.op == "call_function" and node.target is getattr(torch.Tensor, name)


def _reshaped(node: torch.fx.Node) -> bool:
    return _is_method(node, "reshape")


def _expanded(node: torch.fx.Node) -> bool:
    return _is_method(node, "expand")


def _indexed(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem
