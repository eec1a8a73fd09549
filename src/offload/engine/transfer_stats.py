"""`TransferStats`: what an `LLM` moved between host and device memory, with units."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

from offload.engine.kv_cache import KVStats
from offload.offloader.stats import OffloadStats


@dataclass(frozen=True)
class TransferStats:
    """Bytes moved host to device and back (weights and KV cache, CUDA graph replays
    included), the time compute waited for weight copies, the CUDA graph replays and the
    model forwards (prefill chunks and decode steps) that moved them. Running totals add
    (`+`); the figures of one call are `after - before`."""

    weight_copied_bytes: int = 0
    kv_copied_bytes: int = 0
    kv_written_back_bytes: int = 0
    stall_s: float = 0.0
    num_graph_replays: int = 0
    num_forwards: int = 0
    num_compiled_steps: int = 0  # decode steps run by the compiled CPU step (engine/cpu_step)
    compile_s: float = 0.0  # of the time, what compiling those steps took
    disk_read_bytes: int = 0  # weights streamed from the checkpoint's files (disk tier)
    disk_read_s: float = 0.0  # wall time with a read in flight
    disk_stall_s: float = 0.0  # time compute waited for a read
    disk_mapped_bytes: int = 0  # weights computed on in place from mapped files (disk_io mmap)
    num_spec_verifies: int = 0  # speculative decoding: forwards that scored guesses
    num_spec_drafts: int = 0  # a row's guesses scored in one (vLLM's num_drafts)
    num_spec_draft_tokens: int = 0  # tokens guessed (vLLM's num_draft_tokens)
    num_spec_accepted_tokens: int = 0  # guesses the model picked itself (num_accepted_tokens)

    @classmethod
    def of(cls, weights: OffloadStats | None = None, kv: KVStats | None = None) -> TransferStats:
        """The bytes counted so far by a weight offloader's and a KV offloader's `stats()`
        (stalls, forwards and graph replays are the engine's to add)."""
        weights, kv = weights or OffloadStats(), kv or KVStats()
        return cls(
            weight_copied_bytes=weights.bytes_copied,
            kv_copied_bytes=kv.bytes_copied,
            kv_written_back_bytes=kv.bytes_written_back,
            disk_read_bytes=weights.disk.bytes_read,
            disk_read_s=weights.disk.read_s,
            disk_stall_s=weights.disk.stall_s,
            disk_mapped_bytes=weights.disk.bytes_mapped,
        )

    @property
    def disk_read_gb_per_s(self) -> float:
        return self.disk_read_bytes / self.disk_read_s / 1e9 if self.disk_read_s > 0 else 0.0

    @property
    def kv_moved_bytes(self) -> int:
        """KV cache bytes moved both ways."""
        return self.kv_copied_bytes + self.kv_written_back_bytes

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def __add__(self, other: TransferStats) -> TransferStats:
        return self._combine(other, operator.add)

    def __sub__(self, other: TransferStats) -> TransferStats:
        return self._combine(other, operator.sub)

    def _combine(self, other: TransferStats, op: Callable[[float, float], float]) -> TransferStats:
        return TransferStats(
            *(op(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))
        )

    def __repr__(self) -> str:
        return (
            f"TransferStats(weights copied {_mib(self.weight_copied_bytes)}, KV cache copied "
            f"{_mib(self.kv_copied_bytes)} and written back {_mib(self.kv_written_back_bytes)}, "
            f"stall {self.stall_s * 1e3:.0f} ms, {self.num_graph_replays} graph replays, "
            f"{self.num_forwards} forwards{self._disk()})"
        )

    def _disk(self) -> str:
        mapped = (
            f", computed on {_mib(self.disk_mapped_bytes)} of mapped checkpoint files"
            if self.disk_mapped_bytes
            else ""
        )
        if not self.disk_read_bytes:
            return mapped
        return (
            f", read {_mib(self.disk_read_bytes)} from disk at "
            f"{self.disk_read_gb_per_s:.2f} GB/s, I/O stall {self.disk_stall_s * 1e3:.0f} ms"
            f"{mapped}"
        )


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"
