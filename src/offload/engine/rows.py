"""The KV cache of continuous batching: one row per running sequence, each at its own
column, so sequences join and leave the batch at any step.

A transformers `StaticCache` whose layers hold keys and values for `max_rows` rows of
`max_len` columns each. Before each forward the engine says which rows take part (a
contiguous slice: running sequences are kept packed at the front) and which columns each
row writes; the layers write there and hand attention the slice, and the mask the engine
passes (2D, one row per sequence) says which columns each row may read. A prompt is
written right-aligned in its row's first columns (`start` = where it begins), so the
column of a token is its position plus the row's start.

Each row has one column more than it holds, `max_len`: where a padding row writes (a
compiled step runs at least two rows, `RowStep`: its warm-up's are padding); no mask
reads it.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field

import torch

from offload.engine import cpu_linear
from offload.engine.graphs import last_logits
from offload.engine.transformers_cache import cache_argument
from offload.errors import ConfigError
from offload.memory.host import give_back
from offload.memory.kv_shape import KVShape, config_kv_dims


@dataclass(slots=True)  # (no __dict__: a kept step's name holds none of a window's values)
class RowWindow:
    """Which rows the next forward runs, and where each row writes: shared by every
    layer of a `RowCache`."""

    first: int = 0
    last: int = 0  # rows [first, last)
    columns: torch.Tensor | None = None  # [rows, tokens]: each new token's column (or
    rows: torch.Tensor | None = None  # [tokens], a `packed_step`'s, with each token's row)
    width: int = 0  # columns attention reads: [0, width) (what the rows have written, rounded up)
    # Where the mask's causal part starts (a tensor, replayed by CUDA graphs): the last column
    offset: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long))
    mixed: object = None  # a `mixed_step.MixedWindow` while a mixed forward runs


MIN_ROWS = 2  # the fewest rows of the compiled batches' graph (`RowStep`)


class RowCache:
    """`max_rows` rows of `max_len` columns of keys and values in every attention layer,
    on `device`; `cache` is the transformers object a forward takes."""

    def __init__(
        self,
        hf_config,
        max_rows: int,
        max_len: int,
        dtype,
        device,
        dims=None,
        host_pool=None,
        held_layers: tuple[int, ...] | None = None,
    ):
        held = max(max_rows, MIN_ROWS)  # (room for the warm-up step's padding rows)
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

        cache = StaticCache(config=hf_config, max_cache_len=max_len)
        kinds = (StaticLayer, StaticSlidingWindowLayer)
        if any(type(layer) not in kinds for layer in cache.layers):
            raise ConfigError(
                "continuous batching needs a model whose layers all attend over a KV cache "
                "(this one has linear-attention or recurrent layers)"
            )
        # A sliding-window layer keeps every column of its rows, as a full one (not a ring:
        # each row is at its own column), and its mask says which it reads (`RowMasks`).
        self.masks = RowMasks.of(hf_config)
        heads, k_dim, v_dim = dims if dims is not None else config_kv_dims(hf_config)
        self.page_columns = page_columns(hf_config, dtype, (heads, k_dim, v_dim))
        self._host: list[torch.Tensor] = []  # (its keys and values on a CPU: `release`)
        self._written = 0  # (no row wrote a column past this since all were given back)
        self.window = RowWindow(offset=torch.zeros((), dtype=torch.long, device=device))
        self.max_rows, self.max_len, self.dtype, self.held = max_rows, max_len, dtype, held
        # (a pipeline stage's: the layers it runs; the others' keys and values are empty)
        every = range(len(cache.layers))
        self.held_layers = [i for i in every if held_layers is None or i in held_layers]
        # With a host pool, the keys and values live in host memory (KV offload).
        self.kv_offloader = None
        if host_pool is not None:
            shape = KVShape(held, heads, max_len + 1, k_dim, v_dim, dtype)
            self.kv_offloader = _row_kv().RowKVOffloader(
                len(self.held_layers), shape, device, host_pool=host_pool
            )
        for index in every:
            if index not in self.held_layers:  # (never run here: its tensors hold nothing)
                layer = _static_layers().RowLayer(max_len)
                layer.all_keys = layer.all_values = torch.empty(
                    (held, heads, 0, k_dim), dtype=dtype
                )
                layer.keys, layer.values, layer.window = (
                    layer.all_keys,
                    layer.all_values,
                    self.window,
                )
                cache.layers[index] = layer
                continue
            position = self.held_layers.index(index)  # (among the layers held here)
            layer = self._layer(position, max_len)
            layer.window = self.window
            layer.dtype, layer.device = dtype, torch.device(device)
            layer.max_batch_size = layer.batch_size = held
            layer.num_heads, layer.k_head_dim, layer.v_head_dim = heads, k_dim, v_dim
            layer.head_dim = k_dim
            if self.kv_offloader is not None:  # (views of its device slot)
                layer.all_keys, layer.all_values = self.kv_offloader.views(position)
            else:
                layer.all_keys = self._zeros((held, heads, max_len + 1, k_dim), dtype, device)
                layer.all_values = self._zeros((held, heads, max_len + 1, v_dim), dtype, device)
            layer.keys, layer.values = layer.all_keys, layer.all_values
            layer.is_initialized = True
            cache.layers[index] = layer
        self.cache = cache

    def _zeros(self, shape: tuple[int, ...], dtype, device) -> torch.Tensor:
        """Zeros on `device`; on a CPU, in pages the system lends only once written: the
        rows reserve their whole length, but memory holds what they wrote, and `release`
        gives it back."""
        if torch.device(device).type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=device)
        tensor = torch.empty(shape, dtype=dtype, device=device)
        give_back(tensor)
        self._host.append(tensor)
        return tensor

    def release(self, keep: list[int] | None = None) -> None:
        """The memory the rows wrote given back (it reads as zeros again) once no row runs,
        e.g. at the end of `LLM.generate`, but each row's first `keep[row]` columns (the
        prompts prefix caching holds)."""
        for row in range(len(self._host[0]) if self._host and keep and any(keep) else 0):
            self.keep(row, keep[row] if row < len(keep) else 0)
        for tensor in self._host if not keep or not any(keep) else ():
            give_back(tensor)
        self._written = max(keep or [0])

    def keep(self, row: int, num_columns: int) -> None:
        """Row `row`'s columns past its first `num_columns`, up to the highest a forward
        wrote, given back (`_zeros`): a few as zeros in one call a tensor, more as pages."""
        for tensor in self._host if self._written > num_columns else ():
            tail = tensor[row, :, num_columns : self._written]  # [heads, columns, dim]
            if tail[0].nbytes < 4 * mmap.PAGESIZE:
                tail.zero_()
                continue
            for head in range(tensor.shape[1]):  # (each head's columns are contiguous)
                give_back(tail[head])

    @property
    def takes_as_written(self) -> bool:
        """Whether the rows take memory only as they write (on a CPU, not KV offload's
        pinned pool): then more rows than the memory holds at full length can run."""
        return bool(self._host)

    def _layer(self, position: int, max_len: int):
        """A layer's cache, the `position`-th of those held."""
        if self.kv_offloader is None:
            return _static_layers().RowLayer(max_len)
        layer = _static_layers().OffloadedRowLayer(max_len)
        layer.offloader, layer.offloader_id = self.kv_offloader, self.kv_offloader.id
        layer.position = position
        return layer

    def _held(self):
        return [self.cache.layers[i] for i in self.held_layers]

    @property
    def num_bytes(self) -> int:
        """The keys' and values' bytes on the device (the slots' only, with KV offload)."""
        if self.kv_offloader is not None:
            return self.kv_offloader.device_bytes
        return sum(layer.all_keys.nbytes + layer.all_values.nbytes for layer in self.cache.layers)

    def forward_writes(self, high: int) -> None:
        """The next forward writes columns below `high` (padding rows aside): what KV
        offload brings in from then on."""
        self._written = max(self._written, high)
        if self.kv_offloader is not None:
            self.kv_offloader.forward_writes(high)

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
        if self.kv_offloader is not None:  # (on the host; every slot loaded again)
            self.kv_offloader.host_changed()
            self.kv_offloader.move_row(source, target, num_columns)
            return
        for layer in self._held():
            layer.all_keys[target, :, :num_columns] = layer.all_keys[source, :, :num_columns]
            layer.all_values[target, :, :num_columns] = layer.all_values[source, :, :num_columns]

    def move_columns(self, row: int, pairs: list[tuple[int, int]]) -> None:
        """Row `row`'s column a into column b, for each (a, b) of `pairs` in order (a
        speculative tree's kept path brought to the row's next columns)."""
        if self.kv_offloader is not None:  # (on the host; every slot loaded again)
            self.kv_offloader.host_changed()
            self.kv_offloader.move_columns(row, pairs)
            return
        sources, targets = [a for a, _ in pairs], [b for _, b in pairs]
        for layer in self._held():
            for tensor in (layer.all_keys, layer.all_values):
                tensor[row, :, targets] = tensor[row, :, sources]

    def close(self) -> None:
        """End KV offload's copies (its copy thread), if any."""
        if self.kv_offloader is not None:
            self.kv_offloader.close()


class RowMasks:
    """The masks a forward over rows passes where the model has sliding-window layers.
    transformers measures a sliding window from one query column for the whole batch (the
    cache's offset), but each row's query sits at its own column; so the masks are built
    here, transformers' own causal mask with its window overlay moved to each row's query
    (`shift`: the row's query column less the one transformers counts from): one 4D mask
    where every layer slides (Mistral), one per layer type where some do (Gemma 2)."""

    def __init__(self, window: int, layer_types: tuple[str, ...] | None):
        self.window = window
        self.layer_types = layer_types

    @staticmethod
    def of(hf_config) -> RowMasks | None:
        """None where no layer slides (the 2D mask then goes to the model as it is)."""
        window = getattr(hf_config, "sliding_window", None)
        types = getattr(hf_config, "layer_types", None)
        if window is None or (types is not None and "sliding_attention" not in types):
            return None
        return RowMasks(int(window), None if types is None else tuple(dict.fromkeys(types)))

    def __call__(self, model, mask, num_queries: int, shift, cache, dtype):
        """What `model` takes as its attention mask for rows whose 2D `mask` is [rows,
        width], `num_queries` new tokens each, `shift` [rows] (see the class)."""
        from transformers.masking_utils import create_causal_mask, sliding_window_overlay

        overlay = sliding_window_overlay(self.window)

        def row_window(batch_idx, head_idx, q_idx, kv_idx):
            return overlay(batch_idx, head_idx, q_idx + shift[batch_idx], kv_idx)

        shape = (mask.shape[0], num_queries, 1)  # (create_causal_mask reads only its sizes)
        embeds = torch.empty(shape, dtype=dtype, device=mask.device)
        arguments = {"config": model.config, "inputs_embeds": embeds, "attention_mask": mask}
        arguments["cache"] = cache
        sliding = create_causal_mask(**arguments, and_mask_function=row_window)
        if self.layer_types is None:
            return sliding
        full = create_causal_mask(**arguments)
        return {kind: sliding if kind == "sliding_attention" else full for kind in self.layer_types}


class RowStep:
    """One decode forward of rows [0, rows) of a `RowCache`: each row's new token, the
    column it writes, its position and its mask ([rows, width]). As a compiled CPU step
    (`compiled_step.CompiledCpuStep`, `compiled=True`) its width is dynamic, and its rows: one
    graph serves every batch of `MIN_ROWS` to `cpu_linear.MAX_ROWS` rows of any width, since
    a server's batch changes at every step (a graph per shape would be a compile each), and
    one a lone row of any width (its products are one-row loops, as `LLM`'s batch of one;
    in the batches' graph they are MKL's `weight @ x.T`). The window is set inside the step
    from its inputs' sizes, so nothing of it is baked in."""

    def __init__(self, model, rows: RowCache, input_ids, mask, position_ids, columns, compiled):
        self._model = model
        self._rows = rows
        self._cache = cache_argument(model, rows.cache)
        self.input_ids = input_ids  # [rows, 1]
        self.mask = mask  # [rows, width]
        self.position_ids = position_ids  # [rows, 1]
        self.columns = columns  # [rows, 1]
        self.compiled = compiled
        # (the causal part of the mask measured from the last column read: it allows every
        # column, and the 2D mask says which ones each row reads)
        self.cache_position = torch.tensor([mask.shape[1] - 1], device=mask.device)

    @property
    def compile_key(self) -> tuple:
        """Which of its two graphs a step runs (`CompiledCpuStep` keys its graphs so); a
        cache in host memory (KV offload) has graphs of its own. Not the cache's size: its
        rows held and columns are dynamic in the graph (`dynamic_dims`), so `generate`'s
        cores of every size and a server's run the same two graphs, compiled once."""
        key = ("rows" if self.columns.shape[0] >= MIN_ROWS else "row",)
        return key if self._rows.kv_offloader is None else (*key, "kv offload")

    @property
    def inputs(self) -> tuple[torch.Tensor, ...]:
        """What changes from one step to the next (`StepRunner.row_step` refills them)."""
        return self.input_ids, self.mask, self.position_ids, self.columns

    def dynamic_dims(self) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
        """Each tensor of the step with the dims a compiled graph takes as dynamic: the
        rows of a batch, the width, and the cache's rows held and columns. Specialised to
        its cache's size, each call of `generate` whose rows or length rounded otherwise
        compiled its steps again (~40-70 s each for the default model; docs/benchmarks.md)."""
        batch = self.columns.shape[0] >= MIN_ROWS
        dims = [(t, (0,)) for t in (self.input_ids, self.position_ids, self.columns) if batch]
        dims.append((self.mask, (0, 1) if batch else (1,)))
        for layer in self._rows.cache.layers:  # (rows held, columns)
            dims += [(layer.all_keys, (0, 2)), (layer.all_values, (0, 2))]
        return dims

    @property
    def compile_what(self) -> str:
        if self.columns.shape[0] < MIN_ROWS:
            return "a lone row"
        return f"batches of {MIN_ROWS} to {cpu_linear.MAX_ROWS} rows"

    def __call__(self) -> torch.Tensor:
        num_rows, width = self.columns.shape[0], self.mask.shape[1]
        self._rows.select(0, num_rows, self.columns, width - 1, width)
        masks = self._rows.masks
        if masks is None:
            return last_logits(self)
        shift = self.columns[:, 0] - (width - 1)
        mask = masks(self._model, self.mask, 1, shift, self._rows.cache, self._rows.dtype)
        return last_logits(self, mask)


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


def page_columns(hf_config, dtype: torch.dtype, dims=None) -> int:
    """Columns of one head's keys (or values) in a page of memory: what a row's memory is
    taken and given back in (`Scheduler`)."""
    import mmap

    _, k_dim, v_dim = dims if dims is not None else config_kv_dims(hf_config)
    return max(1, mmap.PAGESIZE // (min(k_dim, v_dim) * dtype.itemsize))


def _static_layers():
    """Imported on first use, so that importing offload does not import transformers."""
    from offload.engine import static_layers

    return static_layers


def _row_kv():
    from offload.engine import row_kv  # (imports transformers, as `_static_layers`)

    return row_kv
