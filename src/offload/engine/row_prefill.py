"""A batch's prefill one prompt at a time, each as it runs alone.

A grouped prefill pads the batch's prompts to one width: attention then takes a masked
path over columns the prompt alone would not have, and its sums group differently, so a
prompt's logits (and, through them, its greedy answer) depend on the prompts beside it
(docs/design.md, "Batch invariance"). `LLM.generate` prefills each distinct prompt in a
one-row cache of its own, its prompt at column 0, exactly as a batch of that prompt
alone would, and copies its keys and values into the prompt's rows of the batch's cache,
right-aligned where the batch's decode steps read them (`place`). Columns past a
prompt's end are masked and do not change its sums (checked for float32, bfloat16 and the
stored forms), so the one-row cache's length need not match the batch's.
"""

from __future__ import annotations

import torch

from offload.engine.static_layers import OffloadedStaticLayer, StepStaticLayer


def copyable(cache) -> bool:
    """Whether every layer of `cache` is a static layer of ours (resident or offloaded),
    whose columns `place` can fill; other kinds (sliding windows, linear attention) keep
    the grouped prefill."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(
        type(layer) in (StepStaticLayer, OffloadedStaticLayer) for layer in layers
    )


def place(source, target, row: int, start: int, num_rows: int) -> None:
    """The columns `source`'s one row has written (its prompt, from column 0) into
    columns [start, start + count) of row `row` of `target` (a cache of the same layers
    for `num_rows` rows, not yet written by a forward); the row's columns before `start` zeroed (never read
    unmasked, but a reused host buffer may hold anything, and a masked NaN value still
    poisons attention's product with the values)."""
    for ours, theirs in zip(source.layers, target.layers, strict=True):
        keys, values = _tensors(ours)
        count = _written(ours)
        if not theirs.is_initialized:  # (a resident layer, allocated at its first write)
            theirs.lazy_initialization(
                keys.new_empty((num_rows, keys.shape[1], 1, keys.shape[-1])),
                values.new_empty((num_rows, values.shape[1], 1, values.shape[-1])),
            )
        for mine, other in zip((keys, values), _tensors(theirs), strict=True):
            other[row, :, :start].zero_()
            other[row, :, start : start + count].copy_(mine[0, :, :count])


def written(target, width: int) -> None:
    """Every layer of `target` counts `width` columns written, as a grouped prefill of
    that width leaves them (the next decode step writes column `width`)."""
    for layer in target.layers:
        counter = getattr(layer, "cumulative_length", None)
        if isinstance(counter, torch.Tensor):
            counter.fill_(width)
        if isinstance(layer, OffloadedStaticLayer):
            layer.offloader.lengths[layer.position] = width


def _tensors(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's keys and values, [batch, heads, length, dim]: an offloaded layer's in
    host memory (its device slot is refilled from there), a resident one's as they are."""
    if isinstance(layer, OffloadedStaticLayer):
        offloader = layer.offloader
        return offloader.shape.split(offloader.host_rows[layer.position])
    return layer.keys, layer.values


def _written(layer) -> int:
    if isinstance(layer, OffloadedStaticLayer):
        return layer.offloader.lengths[layer.position]
    return int(layer.cumulative_length)
