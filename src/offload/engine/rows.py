"""The KV cache of continuous batching: one row per running sequence, each at its own
column, so sequences join and leave the batch at any step.

A transformers `StaticCache` whose layers hold keys and values for `max_rows` rows of
`max_len` columns each. Before each forward the engine says which rows take part (a
contiguous slice: running sequences are kept packed at the front) and which columns each
row writes; the layers write there and hand attention the slice, and the mask the engine
passes (2D, one row per sequence) says which columns each row may read. A prompt is
written right-aligned in its row's first columns (`start` = where it begins), so the
column of a token is its position plus the row's start.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from offload.engine.kv_shape import config_kv_dims
from offload.errors import ConfigError


@dataclass
class RowWindow:
    """Which rows the next forward runs, and where each row writes: shared by every
    layer of a `RowCache`."""

    first: int = 0
    last: int = 0  # rows [first, last)
    columns: torch.Tensor | None = None  # [rows, tokens]: the column of each new token
    width: int = 0  # columns attention reads: [0, width) (what the rows have written, rounded up)
    # What the mask's causal part measures from (the first query's column, as a tensor so
    # that a CUDA graph replays it); decode passes the last column, the 2D mask does the rest.
    offset: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long))


class RowCache:
    """`max_rows` rows of `max_len` columns of keys and values in every attention layer,
    on `device`; `cache` is the transformers object a forward takes."""

    def __init__(self, hf_config, max_rows: int, max_len: int, dtype, device, dims=None):
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        cache = StaticCache(config=hf_config, max_cache_len=max_len)
        if any(type(layer) is not StaticLayer for layer in cache.layers):
            raise ConfigError(
                "continuous batching needs a model whose attention layers all see the whole "
                "context (this one has sliding-window or linear-attention layers)"
            )
        heads, k_dim, v_dim = dims if dims is not None else config_kv_dims(hf_config)
        self.window = RowWindow(offset=torch.zeros((), dtype=torch.long, device=device))
        self.max_rows, self.max_len = max_rows, max_len
        for index in range(len(cache.layers)):
            layer = _row_layer_class()(max_len)
            layer.window = self.window
            layer.dtype, layer.device = dtype, torch.device(device)
            layer.max_batch_size = layer.batch_size = max_rows
            layer.num_heads, layer.k_head_dim, layer.v_head_dim = heads, k_dim, v_dim
            layer.head_dim = k_dim
            layer.all_keys = torch.zeros(
                max_rows, heads, max_len, k_dim, dtype=dtype, device=device
            )
            layer.all_values = torch.zeros(
                max_rows, heads, max_len, v_dim, dtype=dtype, device=device
            )
            layer.keys, layer.values = layer.all_keys, layer.all_values
            layer.is_initialized = True
            cache.layers[index] = layer
        self.cache = cache

    @property
    def num_bytes(self) -> int:
        return sum(layer.all_keys.nbytes + layer.all_values.nbytes for layer in self.cache.layers)

    def select(self, first: int, last: int, columns: torch.Tensor, offset: int, width: int) -> None:
        """The next forward runs rows [first, last), writing row i's tokens at
        `columns[i]` ([rows, tokens], on the cache's device) and reading columns
        [0, width) (the mask passed must be that wide)."""
        self.window.first, self.window.last, self.window.columns = first, last, columns
        self.window.width = width
        self.window.offset.fill_(offset)

    def move_row(self, source: int, target: int, num_columns: int) -> None:
        """Row `source`'s first `num_columns` columns into row `target` (packing the
        running rows after one leaves)."""
        for layer in self.cache.layers:
            layer.all_keys[target, :, :num_columns] = layer.all_keys[source, :, :num_columns]
            layer.all_values[target, :, :num_columns] = layer.all_values[source, :, :num_columns]


def read_width(num_columns: int, max_len: int) -> int:
    """Columns a forward reads when its rows have written `num_columns`: the next power
    of two (at least 64, at most `max_len`), so that a few shapes serve every step."""
    width = 64
    while width < num_columns:
        width *= 2
    return min(width, max_len)


def bytes_per_row(hf_config, max_len: int, dtype: torch.dtype, dims=None) -> int:
    """Keys and values of one row of `max_len` columns, over every layer."""
    heads, k_dim, v_dim = dims if dims is not None else config_kv_dims(hf_config)
    per_column = heads * (k_dim + v_dim) * dtype.itemsize
    return per_column * max_len * hf_config.num_hidden_layers


@functools.cache
def _row_layer_class() -> type:
    """Made on first use, so that importing offload does not import transformers."""
    from transformers.cache_utils import StaticLayer

    class RowLayer(StaticLayer):
        """Writes each row's new keys and values at that row's own columns, and gives
        attention the rows of this forward."""

        window: RowWindow
        all_keys: torch.Tensor  # [max_rows, heads, max_len, dim]
        all_values: torch.Tensor

        def lazy_initialization(self, *args, **kwargs) -> None:
            return None  # allocated up front

        def update(self, key_states, value_states, *args, **kwargs):
            window = self.window
            keys = self.all_keys[window.first : window.last, :, : window.width]
            values = self.all_values[window.first : window.last, :, : window.width]
            rows = torch.arange(keys.shape[0], device=keys.device)[:, None]
            rows = rows.expand_as(window.columns)
            # [rows, len, heads, dim] views: one (row, column) pair per new token.
            keys.transpose(1, 2).index_put_((rows, window.columns), key_states.transpose(1, 2))
            values.transpose(1, 2).index_put_((rows, window.columns), value_states.transpose(1, 2))
            return keys, values

        def get_seq_length(self) -> torch.Tensor:
            return self.window.offset

        def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
            return self.window.width, 0

    return RowLayer
