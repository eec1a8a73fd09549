"""Speculative decoding's trees (`engine/spec_tree.py`): their shape, the trees n-gram
lookup and a draft propose, the path a row keeps, the KV columns it moves, and the verify
forward's masks."""

import types

import torch
from hypothesis import given
from hypothesis import strategies as st

from offload.engine.spec_tree import (
    Tree,
    draft_tree,
    lookup_tree,
    moves,
    verify_layout,
    walk,
)
from offload.engine.speculative import lookup

# root -> 5 -> 6 -> 7, and root -> 8 -> 9, and 5 -> 4
TREE = Tree([5, 6, 7, 8, 9, 4], [-1, 0, 1, -1, 3, 0])


def test_a_tree_s_depths_paths_and_children():
    assert TREE.depths() == [0, 1, 2, 3, 1, 2, 2]
    assert TREE.paths() == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 4], [0, 4, 5], [0, 1, 6]]
    assert TREE.child(0, 8) == 4 and TREE.child(1, 4) == 6 and TREE.child(1, 9) is None
    chain = Tree.chain([3, 1, 2])
    assert chain.parents == [-1, 0, 1] and chain.depths() == [0, 1, 2, 3]


def test_lookup_s_tree_starts_with_lookup_s_chain_and_merges_the_other_occurrences():
    tokens = [1, 2, 3, 1, 2, 4, 5, 1, 2, 3, 6, 1, 2]
    tree = lookup_tree(tokens, 1, 2, depth=3, budget=16)
    chain = lookup(tokens, 1, 2, 3)
    assert tree.tokens[: len(chain)] == chain  # (at the row's next columns, in order)
    assert tree.parents[: len(chain)] == list(range(-1, len(chain) - 1))
    continuations = {tuple(tree.tokens[q - 1] for q in path[1:]) for path in tree.paths()[1:]}
    assert (4, 5, 1) in continuations and (3, 1, 2) in continuations  # (both occurrences)
    small = lookup_tree(tokens, 1, 2, depth=3, budget=4)
    assert len(small) == 4 and small.tokens[:3] == chain
    assert lookup_tree([1, 2, 3], 1, 2, depth=3, budget=8) == Tree([], [])


@given(
    st.lists(st.integers(0, 3), min_size=2, max_size=40),
    st.integers(1, 4),
    st.integers(1, 5),
    st.integers(1, 12),
)
def test_every_tree_is_prefix_closed_within_its_budget_and_depth(tokens, high, depth, budget):
    tree = lookup_tree(tokens, 1, high, depth, budget)
    assert len(tree) <= budget
    assert all(parent < node for node, parent in enumerate(tree.parents))  # parents first
    assert max(tree.depths()) <= depth
    for query in range(len(tree) + 1):  # (children of a node hold distinct tokens)
        children = [tree.tokens[n] for n, p in enumerate(tree.parents) if p + 1 == query]
        assert len(children) == len(set(children))
    chain = lookup(tokens, 1, high, depth)
    assert tree.tokens[: min(len(chain), budget)] == chain[:budget]


def test_a_draft_s_tree_is_its_chain_then_its_likeliest_other_tokens():
    alternates = [[(9, 0.3), (8, 0.1)], [(7, 0.2)], [(6, 0.05)]]
    tree = draft_tree([1, 2, 3], alternates, budget=5)
    assert tree.tokens[:3] == [1, 2, 3] and tree.parents[:3] == [-1, 0, 1]
    assert sorted(zip(tree.tokens[3:], tree.parents[3:], strict=True)) == [(7, 0), (9, -1)]


def _row(column, start=0, token=0):
    return types.SimpleNamespace(column=column, start=start, input_token=token, is_live=True)


def test_the_walk_keeps_the_picked_path_and_its_columns_move_in_order():
    logits = torch.zeros(1, len(TREE) + 1, 10)
    picks = {0: 8, 4: 9, 5: 2}  # query -> the token the row picks there

    def choose(live, rows_logits):
        return [picks[int(q)] for q in chosen.pop(0)]

    chosen = []
    original = logits.__getitem__

    class Logits:  # (records which query each round reads)
        shape = logits.shape

        def __getitem__(self, index):
            chosen.append(index[1])
            return original(index)

    paths = walk([TREE], [_row(10)], Logits(), choose)
    assert paths == [[4, 5]]  # 8 then 9, then 2 is no child: the row's own next token
    assert moves([4, 5]) == [(4, 1), (5, 2)]
    assert moves([1, 2, 3]) == []  # (the first branch: in place)


def test_a_tree_s_mask_reads_its_ancestors_and_the_decode_layout_its_path_in_order():
    rows = [_row(4, start=1, token=7), _row(6)]
    laid = verify_layout(rows, [TREE, Tree.chain([1, 2])], 32, lambda high: 16, "cpu")
    assert laid.ids[0] == [7, 5, 6, 7, 8, 9, 4] and laid.ids[1][:3] == [0, 1, 2]
    assert laid.positions[0].tolist() == [4, 5, 6, 7, 5, 6, 6]
    assert laid.columns[1].tolist() == [6, 7, 8, 32, 32, 32, 32]  # (padding: past the end)
    reads = laid.mask[0, 5].nonzero().flatten().tolist()  # node 9: prefix, root, 8, itself
    assert reads == [1, 2, 3, 4, 8, 9]
    assert laid.decode_mask[0, 5].nonzero().flatten().tolist() == [1, 2, 3, 4, 5, 6]
    assert laid.gathers == {(0, 4): [0, 4], (0, 5): [0, 4, 5], (0, 6): [0, 1, 6]}
    chain = laid.mask[1, :3, :10].int().tolist()
    assert chain == [[1] * (7 + q) + [0] * (3 - q) for q in range(3)]  # (a chain: causal)
