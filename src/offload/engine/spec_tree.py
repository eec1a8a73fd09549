"""Speculative decoding's tree form (`speculative_config` with `tree_budget`, SpecExec's
idea): a row's guesses are a tree of candidate continuations, not one chain, all scored by
the same verify forward. Where the weights stream (the disk tier, over the link) scoring
more positions costs little, and a tree keeps a token where the chain's guess was wrong
but a sibling's was right.

A tree is its nodes' tokens and parents in an order where a parent comes before its
children (parent -1: the row's own next token, the root): `Tree(tokens, parents)`; a
chain is the tree whose parents are -1, 0, 1, ... Nodes are laid out depth first, the
likeliest child first, so the likeliest path sits at the row's next columns in order, as
a chain's would: where it is the path kept, no KV column moves.

Node j (query j + 1 of the verify forward; query 0 is the root) is written at the row's
column + j + 1 and attends to the row's columns before it and its ancestors' columns; its
position is the row's next one plus its depth. What the row keeps is a path from the root
(`walk`); its nodes' KV columns are then moved to the row's next columns in order
(`moves`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tree:
    tokens: list[int]
    parents: list[int]  # each node's parent: an earlier node's index, or -1 (the root)

    @staticmethod
    def chain(tokens: list[int]) -> Tree:
        return Tree(list(tokens), list(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Each query's depth: the root's 0, node j's its parent's + 1 (queries 0..len)."""
        depths = [0]
        for parent in self.parents:
            depths.append(depths[parent + 1] + 1)
        return depths

    def paths(self) -> list[list[int]]:
        """Each query's path from the root: the query indices of its ancestors and itself."""
        paths = [[0]]
        for node, parent in enumerate(self.parents):
            paths.append([*paths[parent + 1], node + 1])
        return paths

    def child(self, query: int, token: int) -> int | None:
        """The query index of the child of `query` (0: the root) holding `token`, if any."""
        for node, parent in enumerate(self.parents):
            if parent + 1 == query and self.tokens[node] == token:
                return node + 1
        return None


def ranked(candidates: dict[tuple[int, ...], tuple], budget: int) -> Tree:
    """The tree of the `budget` best-ranked `candidates` (each a path of tokens from the
    root, with its rank: higher first; a path's rank is never above its prefix's), laid out
    depth first, each node's children best first."""
    chosen = sorted(candidates, key=lambda path: (candidates[path], -len(path)), reverse=True)
    children: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for path in chosen[:budget]:  # (best first: each node's children come in rank order)
        children.setdefault(path[:-1], []).append(path)
    tokens: list[int] = []
    parents: list[int] = []

    def visit(path: tuple[int, ...], index: int) -> None:
        for child in children.get(path, ()):
            tokens.append(child[-1])
            parents.append(index)
            visit(child, len(tokens) - 1)

    visit((), -1)
    return Tree(tokens, parents)


def lookup_tree(tokens: list[int], low: int, high: int, depth: int, budget: int) -> Tree:
    """Prompt lookup's tree: what followed every earlier occurrence of the last `high`
    down to `low` tokens, up to `depth` tokens each, merged where they agree. The chain
    that `speculative.lookup` guesses (the longest suffix's latest occurrence) comes first
    and whole; the other nodes by how many occurrences pass through them."""
    length = len(tokens)
    through: dict[tuple[int, ...], list] = {}  # path -> [occurrences, best (size, begin)]
    for size in range(min(high, length - 1), low - 1, -1):
        suffix = tokens[length - size :]
        for begin in range(length - size - 1, -1, -1):
            if tokens[begin : begin + size] != suffix:
                continue
            follow = tuple(tokens[begin + size : begin + size + depth])
            for end in range(1, len(follow) + 1):
                entry = through.setdefault(follow[:end], [0, (size, begin)])
                entry[0] += 1
                entry[1] = max(entry[1], (size, begin))
    if not through:
        return Tree([], [])
    best = max(entry[1] for entry in through.values())
    # (the chain's nodes: their best occurrence is the best of all)
    ranks = {path: (entry[1] == best, entry[0], entry[1]) for path, entry in through.items()}
    return ranked(ranks, budget)


def draft_tree(chain: list[int], alternates: list[list[tuple[int, float]]], budget: int) -> Tree:
    """A draft's tree: its greedy `chain` whole, then the likeliest other tokens at each
    depth (`alternates[d]`: (token, probability of the path to it) at depth d + 1, below
    the chain's first d tokens) while the budget lasts, each a leaf."""
    ranks: dict[tuple[int, ...], tuple] = {}
    for end in range(1, len(chain) + 1):
        ranks[tuple(chain[:end])] = (1, 0.0)
    for depth, options in enumerate(alternates[: len(chain)]):
        for token, probability in options:
            path = (*chain[:depth], token)
            if path not in ranks:
                ranks[path] = (0, probability)
    return ranked(ranks, budget)


def walk(trees: list[Tree], rows, logits, choose) -> list[list[int]]:
    """The path each of `rows` keeps after a verify forward of `trees` (its `logits`
    [rows, queries, vocab]): from the root, the token `choose(live, logits [live,
    vocab])` picks for it (None: it failed), down to the child holding it while one does,
    every live row's pick of a round in one call. The query indices kept past the root,
    in order. (A row's tokens, kept and its last, are appended by `choose`.)"""
    queries = [0] * len(trees)
    paths: list[list[int]] = [[] for _ in trees]
    going = [row.is_live for row in rows]
    while True:
        live = [i for i, row in enumerate(rows) if going[i] and row.is_live]
        if not live:
            return paths
        tokens = choose(live, logits[live, [queries[i] for i in live]])
        for i, token in zip(live, tokens, strict=True):
            child = None if token is None else trees[i].child(queries[i], token)
            going[i] = child is not None
            if child is not None:
                paths[i].append(child)
                queries[i] = child


def moves(path: list[int]) -> list[tuple[int, int]]:
    """(from, to) column offsets past the row's column that bring a kept `path`'s nodes
    to the row's next columns in order (none where they are there already). Safe in
    order: a node's query index is at least its depth."""
    return [(query, depth) for depth, query in enumerate(path, start=1) if query != depth]


@dataclass
class VerifyLayout:
    """A verify forward's inputs for rows each fed its next token and a tree (or nothing):
    `ids` [rows, num]; `reading` each query's column (padding's: capped); `columns` where
    each query writes (padding: past `max_len`); `positions` the column each query stands
    at (the row's next plus its depth); `mask` [rows, num, width] its columns to read;
    `decode_mask` the same in the decode step's layout (its path at its next columns);
    `gathers` {(row, query): the query indices of its path} where that differs; `high`
    the highest column written, plus one."""

    ids: list[list[int]]
    reading: object
    columns: object
    positions: object
    mask: object
    decode_mask: object
    gathers: dict[tuple[int, int], list[int]]
    high: int


def verify_layout(rows, trees: list[Tree | None], max_len: int, width_of, device) -> VerifyLayout:
    """`VerifyLayout` of `rows` (engine rows: `column`, `start`, `input_token`) fed `trees`
    (None: nothing, a padding query), the columns read `width_of(high)` wide."""
    import torch

    fed = [None if tree is None else [row.input_token, *tree.tokens] for row, tree in
           zip(rows, trees, strict=True)]  # fmt: skip
    num = max(len(tokens or ()) for tokens in fed)
    ids = [(tokens or []) + [0] * (num - len(tokens or ())) for tokens in fed]
    first = torch.tensor([row.column for row in rows], device=device)[:, None]
    real = torch.tensor([len(tokens or ()) for tokens in fed], device=device)[:, None]
    steps = torch.arange(num, device=device)[None, :]
    reading = (first + steps).clamp(max=max_len - 1)  # [rows, num]: each query's column
    columns = torch.where(steps < real, reading, max_len)  # (padding: past the end)
    # (a padding query stands at its own column, as a chain's would)
    depths = [
        (tree.depths() if tree is not None else [0]) + list(range(len(tree or ()) + 1, num))
        for tree in trees
    ]
    positions = (first + torch.tensor(depths, device=device)).clamp(max=max_len - 1)
    high = int(torch.where(real > 0, first + real, 0).max())
    width = width_of(high)
    start = torch.tensor([row.start for row in rows], device=device)[:, None, None]
    every = torch.arange(width, device=device)[None, None, :]
    mask = (every >= start) & (every <= reading[:, :, None])  # [rows, num, width]
    decode_mask = (every >= start) & (every <= positions[:, :, None])
    gathers: dict[tuple[int, int], list[int]] = {}
    for index, (row, tree) in enumerate(zip(rows, trees, strict=True)):
        if tree is None or tree.parents == list(range(-1, len(tree) - 1)):
            continue  # (a chain: its mask is the decode step's)
        span = mask[index, : len(tree) + 1, row.column : row.column + len(tree) + 1]
        span.zero_()
        for query, path in enumerate(tree.paths()):
            span[query, path] = True
            if path != list(range(len(path))):
                gathers[index, query] = path
    return VerifyLayout(ids, reading, columns, positions, mask, decode_mask, gathers, high)
