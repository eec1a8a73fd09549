"""The shape of a cache layer's keys and values, derived in one place from a model
config (or from what `probe_kv_dims` saw): sizing (`planner/fit.py`) and the host KV cache
(`engine/kv_cache.py`) both read it; the device slots of the host KV cache's ring; and
whether the host has room for such a cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offload.errors import ConfigError
from offload.memory.host import available_ram_bytes
from offload.sizes import GIB as _GIB

KV_SLOTS = 2  # device slots of the KV ring: the next layer arrives while one computes


@dataclass(frozen=True)
class KVShape:
    """One layer's keys and values: [batch, num_heads, max_cache_len, head_dim]."""

    batch: int
    num_heads: int
    max_cache_len: int
    k_head_dim: int
    v_head_dim: int
    dtype: torch.dtype

    @property
    def row_elements(self) -> int:
        """Elements of one position (keys, then values, of every sequence and head)."""
        return self.batch * self.num_heads * (self.k_head_dim + self.v_head_dim)

    @property
    def row_bytes(self) -> int:
        return self.row_elements * self.dtype.itemsize

    @property
    def layer_bytes(self) -> int:
        return self.max_cache_len * self.row_bytes

    def split(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values as transformers wants them, [batch, heads, len, dim], viewed
        over `rows` ([max_cache_len, row_elements]): no copy, fixed addresses."""
        keys_width = self.batch * self.num_heads * self.k_head_dim
        keys = rows[:, :keys_width].unflatten(1, (self.batch, self.num_heads, self.k_head_dim))
        values = rows[:, keys_width:].unflatten(1, (self.batch, self.num_heads, self.v_head_dim))
        return keys.permute(1, 2, 0, 3), values.permute(1, 2, 0, 3)


def config_kv_dims(hf_config) -> tuple[int, int, int]:
    """(heads, key dim, value dim) from the config's usual fields: the key-value heads
    (grouped-query attention) and `head_dim`, else hidden size over attention heads."""
    heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    head_dim = (
        getattr(hf_config, "head_dim", None)
        or hf_config.hidden_size // hf_config.num_attention_heads
    )
    return heads, head_dim, head_dim


def kv_shape_of(
    hf_config,
    batch: int,
    max_cache_len: int,
    dtype: torch.dtype,
    dims: tuple[int, int, int] | None = None,
) -> KVShape:
    """A cache layer's shape: from `dims` (heads, key dim, value dim, as `probe_kv_dims`
    measures them) or else from the config's usual fields."""
    heads, k_head_dim, v_head_dim = dims if dims is not None else config_kv_dims(hf_config)
    return KVShape(batch, heads, max_cache_len, k_head_dim, v_head_dim, dtype)


def check_host_kv(
    shape: KVShape, num_layers: int, swap_space_bytes: int, held_bytes: int = 0
) -> None:
    """Refuse, before allocating, a host KV cache larger than `swap_space` (when set) or
    than the RAM available (counting the `held_bytes` a `KVHostPool` would give back)."""
    need = shape.layer_bytes * num_layers
    limit = swap_space_bytes or available_ram_bytes() + held_bytes
    if need > limit:
        what = "swap_space" if swap_space_bytes else "the RAM available"
        raise ConfigError(
            f"the KV cache for {shape.batch} sequence(s) of {shape.max_cache_len} positions "
            f"needs {_size(need)} of host memory, more than {what} ({_size(limit)}); "
            "lower max_tokens, max_model_len or the batch, or raise swap_space"
        )


def _size(num_bytes: int) -> str:
    return f"{num_bytes / _GIB:.2f} GiB" if num_bytes >= _GIB else f"{num_bytes / 2**20:.1f} MiB"
