"""The rows' KV cache on a CPU gives back what a row wrote once it is no longer held:
past a kept prefix (`keep`, when a row is taken by a new request) and at `release`,
the columns read as zeros again, the other rows' columns untouched."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from offload.engine.rows import RowCache

CONFIG = LlamaConfig(
    vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
)  # fmt: skip


def _written(cache: RowCache, rows: int, columns: int) -> list[torch.Tensor]:
    """Every held layer's keys and values, their first `rows` rows written with ones up
    to `columns` as a forward writes them (`forward_writes` first)."""
    cache.forward_writes(columns)
    tensors = []
    for layer in cache.cache.layers:
        for tensor in (layer.all_keys, layer.all_values):
            tensor[:rows, :, :columns] = 1.0
            tensors.append(tensor)
    return tensors


@pytest.mark.parametrize("columns", [40, 3000])  # (zeros written; pages handed back)
def test_a_kept_row_reads_zeros_past_its_prefix_and_the_others_keep_theirs(columns):
    cache = RowCache(CONFIG, max_rows=4, max_len=4000, dtype=torch.float32, device="cpu")
    tensors = _written(cache, rows=3, columns=columns)
    cache.keep(1, 10)
    for tensor in tensors:
        assert torch.all(tensor[1, :, :10] == 1) and not tensor[1, :, 10:].any()
        assert torch.all(tensor[0, :, :columns] == 1) and torch.all(tensor[2, :, :columns] == 1)
    cache.release([5, 0, 7])
    for tensor in tensors:
        assert torch.all(tensor[0, :, :5] == 1) and not tensor[0, :, 5:].any()
        assert not tensor[1].any()
        assert torch.all(tensor[2, :, :7] == 1) and not tensor[2, :, 7:].any()
    tensors = _written(cache, rows=2, columns=20)  # (a later forward: below the last high)
    cache.keep(0, 2)
    assert all(not tensor[0, :, 2:].any() for tensor in tensors)
    cache.release()
    assert all(not tensor.any() for tensor in tensors)
