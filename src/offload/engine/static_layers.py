"""transformers' `StaticLayer` as a compiled step, KV offload and continuous batching need
it: the classes at a module's top level (a compiled step kept on disk names its objects'
classes), in a module of their own because it imports transformers (`transformers_cache`
and `rows` import it on first use)."""

from __future__ import annotations

import torch
from transformers.cache_utils import StaticLayer

from offload.engine.kv_cache import KVOffloader
from offload.offloader import ops


class StepStaticLayer(StaticLayer):
    """A `StaticLayer` whose update, in a compiled step, is one op (`UPDATE_OP`): the
    same op at the same place as an offloaded layer's, so that inductor splits its
    fusions alike and a compiled offloaded step computes the resident one's bits."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not torch.compiler.is_compiling() or not self.is_initialized:
            return super().update(key_states, value_states, *args, **kwargs)
        positions = self._positions(key_states, args, kwargs)
        self._write(key_states, value_states, positions)
        return self.keys, self.values

    def _positions(self, key_states, args, kwargs) -> torch.Tensor:
        """The new tokens' positions, counted on (transformers >= 5.17 counts them
        itself) or as the caller passes them."""
        count = key_states.shape[-2]
        cache_kwargs = kwargs.get("cache_kwargs", args[0] if args else None)
        positions = cache_kwargs.get("cache_position") if isinstance(cache_kwargs, dict) else None
        counter = getattr(self, "cumulative_length", None)
        if positions is None:
            # (not an offloader's Python count where a counter is: a compiled step
            # would guard on its value and trace again at every token)
            start = self._written() if counter is None else counter
            positions = torch.arange(count, device=self.device) + start
        if counter is not None:
            counter.add_(count)
        return positions

    def _written(self) -> int:
        raise RuntimeError("a static cache layer without a position counter")

    def _write(self, key_states, value_states, positions, offloader_id=ops.NO_OFFLOADER):
        kv = [self.keys, self.values]
        position = getattr(self, "position", 0)
        UPDATE_OP(kv, key_states, value_states, positions, offloader_id, position)


class OffloadedStaticLayer(StepStaticLayer):
    """A `StaticLayer` whose keys and values are views of a device slot that a
    `KVOffloader` fills from host memory before each update."""

    offloader: KVOffloader
    offloader_id: int  # its `ops` id
    position: int

    def lazy_initialization(self, *args, **kwargs) -> None:
        return None  # allocated up front, by the offloader

    def update(self, key_states, value_states, *args, **kwargs):
        positions = self._positions(key_states, args, kwargs)
        if torch.compiler.is_compiling():  # one op: the step's graph stays whole
            # (its id, not the offloader: a step kept on disk pickles what its guards
            # read, and an offloader holds host memory and a copy thread)
            self._write(key_states, value_states, positions, self.offloader_id)
        else:
            keys, values = self.keys, self.values
            _update(
                self.offloader, self.position, keys, values, key_states, value_states, positions
            )
        return self.keys, self.values

    def _written(self) -> int:
        return self.offloader.lengths[self.position]

    def get_seq_length(self) -> int | torch.Tensor:
        # As StaticLayer: the device counter where there is one. The mask's query
        # offset is read from here, and a Python int would be frozen into a CUDA graph
        # at its capture (every replay then masked as the captured step).
        counter = getattr(self, "cumulative_length", None)
        if isinstance(counter, torch.Tensor):
            return counter
        return self.offloader.lengths[self.position]


def _update(offloader, position: int, keys, values, key_states, value_states, positions):
    """A layer's cache update: (an offloaded one's, `offloader` not None: its slot filled)
    the new positions written (and back to the host)."""
    if offloader is not None:
        offloader.before_update(position)
    keys.index_copy_(2, positions, key_states)
    values.index_copy_(2, positions, value_states)
    if offloader is not None:
        offloader.after_update(position, positions, key_states.shape[-2])


def _update_kernel(kv, key_states, value_states, positions, offloader_id: int, position: int):
    offloader = None
    if offloader_id != ops.NO_OFFLOADER:
        offloader = ops.offloader(offloader_id)
        offloader.check_compiled(position, kv[0])
    _update(offloader, position, *kv, key_states, value_states, positions)


def _no_update(kv, key_states, value_states, positions, offloader_id: int, position: int):
    return None


def _define_update_op():
    """`offload::kv_update`: a static cache layer's update as one op in a compiled step,
    resident (`ops.NO_OFFLOADER`) or offloaded. Traced through, an offloaded layer's
    per-layer Python (the slot table, the copy engine's clock) broke the graph in every
    layer, and past dynamo's recompile limit the later layers' attention ran eagerly; and
    where inductor fused a resident layer's writes with the work around them but could not
    an offloaded one's, a batch summed in another order. It declares the layer's keys and
    values mutated, so their reads come after it."""
    schema = (
        "(Tensor(a!)[] kv, Tensor key_states, Tensor value_states, Tensor positions, "
        "int offloader_id, int position) -> ()"
    )
    return ops.define_op("kv_update", schema, _update_kernel, _no_update)


UPDATE_OP = _define_update_op()  # (at import: dynamo cannot trace a define)


class RowLayer(StaticLayer):
    """A layer of continuous batching's cache (`rows.RowCache`): writes each row's new keys
    and values at that row's own columns, and gives attention the rows of this forward."""

    window: object  # the cache's `rows.RowWindow` (not imported: rows imports this module)
    all_keys: torch.Tensor  # [rows, heads, max_len + 1, dim]
    all_values: torch.Tensor

    def lazy_initialization(self, *args, **kwargs) -> None:
        return None  # allocated up front

    def update(self, key_states, value_states, *args, **kwargs):
        window = self.window
        kv = [self.all_keys, self.all_values]
        if window.rows is not None:  # (a packed step's tokens, each at its own row)
            TOKENS_UPDATE_OP(kv, key_states, value_states, window.columns, window.rows)
            return self.all_keys, self.all_values
        if torch.compiler.is_compiling():  # one op, in place (`ROW_UPDATE_OP`)
            ROW_UPDATE_OP(kv, key_states, value_states, window.columns, window.first)
        elif window.mixed is not None:  # (a decode step with a prompt's chunk: `mixed_step`)
            for part in window.mixed.parts(key_states, value_states):
                write_rows(kv, *part)
            return self.all_keys, self.all_values
        else:
            write_rows(kv, key_states, value_states, window.columns, window.first)
        keys = self.all_keys[window.first : window.last, :, : window.width]
        values = self.all_values[window.first : window.last, :, : window.width]
        return keys, values

    def get_seq_length(self) -> torch.Tensor:
        return self.window.offset

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.window.width, 0


def write_rows(kv, key_states, value_states, columns, first: int) -> None:
    """Rows [first, first + len(columns)) of a `RowLayer`'s keys and values: each row's new
    tokens written at its `columns` ([rows, tokens]; a padding row's in the column past
    max_len, which attention does not read); or, `columns` a slice, row `first`'s columns
    there (a prompt's chunk: a copy, not an indexed write)."""
    if isinstance(columns, slice):
        for cache, states in zip(kv, (key_states, value_states), strict=True):
            cache[first : first + 1, :, columns].copy_(states)
        return
    num_rows = columns.shape[0]
    rows = torch.arange(num_rows, device=columns.device)[:, None].expand_as(columns)
    for cache, states in zip(kv, (key_states, value_states), strict=True):
        # [rows, len, heads, dim] views: one (row, column) pair per new token
        view = cache[first : first + num_rows].transpose(1, 2)
        view.index_put_((rows, columns), states.transpose(1, 2))


def _no_row_update(kv, key_states, value_states, columns, first: int) -> None:
    return None


def write_tokens(kv, key_states, value_states, columns, rows) -> None:
    """A packed step's tokens' keys and values ([1, heads, tokens, dim]): token t's at
    column `columns[t]` of row `rows[t]` (`packed_step`)."""
    for cache, states in zip(kv, (key_states, value_states), strict=True):
        cache.transpose(1, 2).index_put_((rows, columns), states[0].transpose(0, 1))


def _no_tokens_update(kv, key_states, value_states, columns, rows) -> None:
    return None


# `offload::row_kv_update`: a `RowLayer`'s writes as one op of a compiled step, declared to
# mutate the layer's keys and values in place. Traced through, the writes into a slice of
# rows of dynamic size were functionalized into a copy of every row's whole cache (all
# `max_model_len` columns) at each step: a 32-row step took many times as long
# (docs/benchmarks.md, "2026-11-28 (nineteenth session): the server's batched step compiled
# (issue 28)").
ROW_UPDATE_OP = ops.define_op(
    "row_kv_update",
    "(Tensor(a!)[] kv, Tensor key_states, Tensor value_states, Tensor columns, SymInt first) -> ()",
    write_rows,
    _no_row_update,
)


# `offload::tokens_kv_update`: a packed step's writes, one op compiled or eager.
TOKENS_UPDATE_OP = ops.define_op(
    "tokens_kv_update",
    "(Tensor(a!)[] kv, Tensor key_states, Tensor value_states, Tensor columns, Tensor rows) -> ()",
    write_tokens,
    _no_tokens_update,
)


class OffloadedRowLayer(RowLayer):
    """A `RowLayer` whose keys and values live in host memory (`row_kv.RowKVOffloader`):
    `all_keys` and `all_values` are views of a device slot that the offloader fills
    before the layer's update; each new token is written to the slot and to the host."""

    offloader: object  # its `RowKVOffloader` (not imported: it imports this module's base)
    offloader_id: int  # its `ops` id
    position: int  # its number among the offloaded layers

    def update(self, key_states, value_states, *args, **kwargs):
        window = self.window
        kv = [self.all_keys, self.all_values]
        if torch.compiler.is_compiling():  # one op (its id, not the offloader: see above)
            OFFLOADED_ROW_UPDATE_OP(
                kv, key_states, value_states, window.columns, window.first,
                self.offloader_id, self.position,
            )  # fmt: skip
        elif window.mixed is not None:  # (see `RowLayer.update`)
            parts = window.mixed.parts(key_states, value_states)
            self.offloader.rows_update_at(self.position, kv, parts)
            return self.all_keys, self.all_values
        else:
            self.offloader.row_update_at(
                self.position, kv, key_states, value_states, window.columns, window.first
            )
        keys = self.all_keys[window.first : window.last, :, : window.width]
        values = self.all_values[window.first : window.last, :, : window.width]
        return keys, values


def _offloaded_row_update(
    kv, key_states, value_states, columns, first: int, offloader_id: int, position: int
) -> None:
    offloader = ops.offloader(offloader_id)
    offloader.check_compiled(position, kv[0])
    offloader.row_update_at(position, kv, key_states, value_states, columns, first)


def _no_offloaded_row_update(
    kv, key_states, value_states, columns, first: int, offloader_id: int, position: int
) -> None:
    return None


# `offload::offloaded_row_kv_update`: an offloaded `RowLayer`'s slot filled, its writes made
# and written back to the host, as one op of a compiled step (as `UPDATE_OP` is for an
# offloaded static layer).
OFFLOADED_ROW_UPDATE_OP = ops.define_op(
    "offloaded_row_kv_update",
    "(Tensor(a!)[] kv, Tensor key_states, Tensor value_states, Tensor columns, SymInt first, "
    "int offloader_id, int position) -> ()",
    _offloaded_row_update,
    _no_offloaded_row_update,
)
