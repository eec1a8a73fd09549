"""A safetensors file written tensor by tensor, for conversions that make each tensor in
turn: every tensor's dtype and shape are known before the first is made, so the header
(which comes first in the format) is written first, then each tensor's bytes as they come,
and nothing holds more than the tensor being written.

The header is padded with spaces (as the format allows) so that the tensors' bytes begin
at a multiple of `DATA_ALIGN`: the disk tier reads or maps a tensor at its file offset
modulo the page, and a product over a weight off that boundary pays a copy. A writer that
fails or is interrupted removes its half-written file; `close` makes the bytes durable
(`fsync`) before anyone may trust the file, and drops them from the page cache (a
conversion leaves the cache as it found it: a model larger than memory is then read as
every later run reads it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from offload.memory.safetensors import DTYPES, REFERENCES, StoredTensor

DATA_ALIGN = 64  # bytes (the CPU allocator's alignment)
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor a writer will write: its name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


def header_of(entries: Sequence[TensorEntry]) -> bytes:
    """The 8-byte length and the JSON header of a file of `entries` in their order, padded
    so that the data begins at a multiple of `DATA_ALIGN`."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        header[entry.name] = {
            "dtype": DTYPE_NAMES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.num_bytes],
        }
        offset += entry.num_bytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % DATA_ALIGN)
    return len(text).to_bytes(8, "little") + text


def file_bytes(entries: Sequence[TensorEntry]) -> int:
    """The size of the file `SafetensorsWriter` writes for `entries`."""
    return len(header_of(entries)) + sum(entry.num_bytes for entry in entries)


class SafetensorsWriter:
    """Writes `entries` into `path`, in their order, one `write` each; `close` checks that
    all were written, makes the file durable and drops its pages from the page cache. Used
    as a context manager, a failure (or Ctrl-C) inside removes the file."""

    def __init__(self, path: Path, entries: Sequence[TensorEntry]):
        self.path = Path(path)
        self._entries = list(entries)
        self._next = 0
        self._file = self.path.open("xb")  # (never over a file someone else may read)
        self._file.write(header_of(self._entries))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor's bytes (any contiguous CPU tensor of its dtype and shape)."""
        if self._next >= len(self._entries):
            raise ValueError(f"{self.path}: {name} is one tensor more than its header holds")
        entry = self._entries[self._next]
        if (name, tensor.dtype, tuple(tensor.shape)) != (entry.name, entry.dtype, entry.shape):
            raise ValueError(
                f"{self.path}: expected {entry.name} {entry.dtype} {list(entry.shape)} next, "
                f"got {name} {tensor.dtype} {list(tensor.shape)}"
            )
        flat = tensor.detach().contiguous().reshape(-1)
        if flat.numel():
            self._file.write(memoryview(flat.view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._entries):
            missing = self._entries[self._next].name
            raise ValueError(f"{self.path}: closed before {missing} was written")
        self._file.flush()
        os.fsync(self._file.fileno())  # durable before the folder is renamed into place
        os.posix_fadvise(self._file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        self._file.close()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, kind, *_) -> None:
        try:
            if kind is None:
                self.close()
                return
        except BaseException:
            self._discard()
            raise
        self._discard()

    def _discard(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)


def write_references(folder: Path, source: Path, tensors: Mapping[str, StoredTensor]) -> None:
    """`folder`'s references to `tensors` (all in `source`), as of `source` now."""
    stat = Path(source).stat()
    entries = {
        name: {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "offset": t.offset}
        for name, t in tensors.items()
    }
    document = {
        "file": str(Path(source).resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "tensors": entries,
    }
    (folder / REFERENCES).write_text(json.dumps(document, indent=1))
