"""Speculative decoding's draft model (`speculative_config` with a `model`): a smaller
model with the same tokenizer guesses each running sequence's next tokens greedily, over
a KV cache of its own.

The draft's cache has a row for each of the engine's rows, in the same place (row i of
the engine's batch is row i here), each holding its sequence's tokens from column 0 (no
left padding: the draft's rows never share a forward with a prompt of another width).
What a row holds is known by the tokens it was fed: at each step a row is fed what its
sequence has gained since (the tokens kept from the last guesses, or a whole prompt for
a new sequence), then guesses one token per draft step. Where the engine moved a
sequence to another row (packing, preemption), the draft's row is copied after it, or
fed again from the start where nothing holds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offload.engine.requests import EngineModel
from offload.engine.spec_tree import Tree, draft_tree
from offload.engine.step_runner import StepRunner

_CATCH_UP = 16  # more tokens than this to feed: fed alone (a prompt), not padded beside others


@dataclass(eq=False)
class _DraftRow:
    """What a `StepRunner` reads of a row (as the engine's `Row`), for the draft's rows."""

    column: int = 0  # where its next token is written: how many tokens it holds
    input_token: int = 0
    start: int = 0
    is_live: bool = True
    eager: bool = False
    replaying: bool = False

    def advance(self, exact: bool) -> None:  # (`Row.advance`; the draft holds no prefixes)
        self.column += self.is_live


class DraftProposer:
    """Greedy guesses by the draft `model` (an `EngineModel` of the draft) for an engine
    of `max_rows` rows of `max_len` positions; `config` the `SpeculativeConfig`."""

    def __init__(self, config, model: EngineModel, max_rows: int, max_len: int):
        self.config = config
        self.model = model
        self.runner = StepRunner(model, max_rows, max_len)
        self.max_len = max_len
        self._fed: list[list[int]] = [[] for _ in range(max_rows)]  # each row's tokens, by column

    def propose(self, rows, counts: list[int]) -> list[list[int]]:
        """Up to `counts[i]` greedy guesses for the engine's `rows[i]` (rows [0, len) of
        its cache, each past its last token's pick)."""
        return self._guess(rows, counts)[0]

    def propose_tree(self, rows, counts: list[int], budgets: list[int]) -> list[Tree]:
        """Each row's greedy chain of `counts[i]` guesses, and where `budgets[i]` leaves
        room, the draft's likeliest other tokens beside it (`spec_tree.draft_tree`)."""
        chains, alternates = self._guess(rows, counts, max(budgets))
        return [
            draft_tree(chain, options, budget)
            for chain, options, budget in zip(chains, alternates, budgets, strict=True)
        ]

    def _guess(self, rows, counts: list[int], others: int = 0):
        """Each row's greedy chain, and at each of its depths the `others` likeliest other
        tokens with the draft's probability of the path to them."""
        sequences = [row.sequence.prompt_ids + row.sequence.tokens for row in rows]
        alternates: list[list[list[tuple[int, float]]]] = [[] for _ in rows]
        reach = [1.0] * len(rows)  # the draft's probability of each row's chain so far
        with self.model.lock, torch.inference_mode():
            draft_rows = self._caught_up(sequences)
            logits = self._catch_up(draft_rows, sequences)  # [rows, vocab]: each row's next
            guesses: list[list[int]] = [[] for _ in rows]
            for step in range(max(counts)):
                tokens = logits.argmax(-1).tolist()
                if others:
                    _alternates(logits, tokens, reach, others, alternates)
                for i, token in enumerate(tokens):
                    if step < counts[i]:
                        guesses[i].append(token)
                if step + 1 == max(counts):
                    break
                for i, (row, token) in enumerate(zip(draft_rows, tokens, strict=True)):
                    row.input_token = token
                    row.is_live = row.column < self.max_len - 1 and step + 1 < counts[i]
                    if row.is_live:
                        self._fed[i].append(token)
                logits = self.runner.decode(draft_rows)
        return guesses, alternates

    def _caught_up(self, sequences: list[list[int]]) -> list[_DraftRow]:
        """The draft's rows for the engine's sequences: each at the longest prefix of its
        sequence that it holds (moved from the row that holds it, where the engine moved
        the sequence)."""
        draft_rows = []
        for i, tokens in enumerate(sequences):
            held = _common(self._fed[i], tokens)
            if held < len(tokens) // 2:  # (another sequence's: one moved here, or a new one)
                source = max(range(len(self._fed)), key=lambda j: _common(self._fed[j], tokens))
                moved = _common(self._fed[source], tokens)
                if moved > held and source != i:
                    self.runner.cache.move_row(source, i, moved)
                    self._fed[i], held = self._fed[source][:moved], moved
            held = min(held, len(tokens) - 1)  # (its last token fed again: its logits guess)
            del self._fed[i][held:]
            draft_rows.append(_DraftRow(column=held))
        return draft_rows

    def _catch_up(self, draft_rows: list[_DraftRow], sequences: list[list[int]]) -> torch.Tensor:
        """Each row fed what its sequence gained since it last ran (at least its last
        token, whose logits give the first guess): the rows with a few tokens in one
        forward, each long one (a new prompt) alone. The logits of each row's last token."""
        logits: list[torch.Tensor | None] = [None] * len(draft_rows)
        short = [
            i
            for i, tokens in enumerate(sequences)
            if len(tokens) - draft_rows[i].column <= _CATCH_UP
        ]
        for group in ([short] if short else []) + [
            [i] for i in range(len(draft_rows)) if i not in short
        ]:
            out = self._feed(draft_rows, sequences, group)
            for i in group:
                logits[i] = out[i]
        for i, tokens in enumerate(sequences):
            self._fed[i] = tokens[:]
            draft_rows[i].column = len(tokens)
        return torch.stack(logits)

    def _feed(self, draft_rows, sequences, group: list[int]) -> dict[int, torch.Tensor]:
        """One verify forward of rows [0, last of `group`] feeding `group`'s rows their
        missing tokens (the other rows a padding query each): each group row's last logits."""
        rows = draft_rows[: max(group) + 1]
        feeds: list[list[int] | None] = []
        for i, row in enumerate(rows):
            missing = sequences[i][row.column :] if i in group else []
            row.input_token = missing[0] if missing else 0
            feeds.append(missing[1:] if missing else None)  # (None: this forward feeds it nothing)
        logits = self.runner.verify(rows, feeds)
        return {i: logits[i, len(feeds[i])] for i in group}


def _alternates(logits, tokens: list[int], reach: list[float], others: int, into) -> None:
    """The `others` likeliest tokens of each row beside its greedy one (`tokens`), with the
    probability of the path to them (`reach`: its chain's so far, which then takes in the
    greedy token's), appended to `into[row]`."""
    top = logits.float().softmax(-1).topk(min(others + 1, logits.shape[-1]))
    for i, (shares, ids) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True)):
        into[i].append(
            [(t, reach[i] * p) for t, p in zip(ids, shares, strict=True) if t != tokens[i]]
        )
        reach[i] *= shares[ids.index(tokens[i])] if tokens[i] in ids else 0.0


def _common(fed: list[int], tokens: list[int]) -> int:
    """How many first tokens `fed` and `tokens` share."""
    count = min(len(fed), len(tokens))
    for index in range(count):
        if fed[index] != tokens[index]:
            return index
    return count
