"""KV offload for the engine core's rows (`rows.RowCache`): each attention layer's keys
and values for every row live in host memory, and a ring of `KV_SLOTS` device slots
receives a layer's just before its update, as `kv_cache.KVOffloader` does for `generate`'s
static cache (the same slot table, copy engine and host layout: one position of every row
per host row, so "the first L columns of every row" is one contiguous copy).

What rows change: a row writes at its own column, so the columns brought in are those
below the highest column any row has written (`lengths`), and each new token is written
to the slot and, at once, to its (row, column) in the host copy. Packing the rows (a
finished row refilled by the last running one) and copying a prompt into a request's
other rows move host bytes: every slot is then forgotten and loaded again.
"""

from __future__ import annotations

import torch

from offload.engine.kv_cache import KVHostPool, KVOffloader
from offload.engine.static_layers import write_rows
from offload.memory.kv_shape import KV_SLOTS, KVShape


class RowKVOffloader(KVOffloader):
    """Host-resident keys and values of `num_layers` row-cache layers of `shape` (its
    batch: the rows held; its positions: `max_len` + 1 columns, the last a padding row's)."""

    def __init__(
        self,
        num_layers: int,
        shape: KVShape,
        device: torch.device,
        *,
        host_pool: KVHostPool,
        disable_pin_memory: bool = False,
    ):
        super().__init__(
            num_layers,
            shape,
            device,
            num_slots=KV_SLOTS,
            disable_pin_memory=disable_pin_memory,
            host_pool=host_pool,
        )
        self.max_len = shape.max_cache_len - 1
        for rows in self.host_rows:  # (a pool's old bytes: a masked column must be finite)
            rows.zero_()
        self._host_kv = [list(shape.split(rows)) for rows in self._host_writable]
        self._high = 0  # the highest column the forward under way writes, plus one

    def forward_writes(self, high: int) -> None:
        """The next forward writes columns below `high` (padding rows aside)."""
        self._high = high

    def row_update_at(self, layer: int, kv, key_states, value_states, columns, first: int):
        """`layer`'s update: its slot filled, the new tokens written at each row's
        `columns` (rows from `first`) there and in the host copy."""
        self.rows_update_at(layer, kv, [(key_states, value_states, columns, first)])

    def rows_update_at(self, layer: int, kv, parts: list[tuple]) -> None:
        """`row_update_at` of several parts (keys, values, columns, first row) at once, as
        a mixed forward writes them (`mixed_step`): the slot filled once."""
        self.before_update(layer)
        for key_states, value_states, columns, first in parts:
            write_rows(kv, key_states, value_states, columns, first)
            write_rows(self._host_kv[layer], key_states, value_states, columns, first)
            tokens = key_states.shape[0] * key_states.shape[2]  # (rows x new columns)
            self.bytes_written_back += tokens * self.shape.row_bytes // self.shape.batch
        self.lengths[layer] = max(self.lengths[layer], self._high)
        self._last = layer

    def host_changed(self) -> None:
        """Rows were moved in the host copy: wait for every copy in flight, then forget
        what every slot holds (each is loaded again before it is read)."""
        self._engine.synchronize()
        self._table.owner = [None] * self._table.slots
        self._tickets = [None] * self._table.slots
        self._last = None

    def move_row(self, source: int, target: int, num_columns: int) -> None:
        """Row `source`'s first `num_columns` columns into row `target`, on the host."""
        for tensor in self._host_kv_all():
            tensor[target, :, :num_columns] = tensor[source, :, :num_columns]

    def move_columns(self, row: int, pairs: list[tuple[int, int]]) -> None:
        """Row `row`'s column a into column b for each (a, b) of `pairs`, on the host."""
        sources, targets = [a for a, _ in pairs], [b for _, b in pairs]
        for tensor in self._host_kv_all():
            tensor[row, :, targets] = tensor[row, :, sources]

    def _host_kv_all(self):
        for keys, values in self._host_kv:
            yield keys
            yield values
