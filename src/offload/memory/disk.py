"""safetensors files read by byte range, straight into the tensor that will hold the data.

The header (8-byte little-endian length, then JSON) gives each tensor's dtype, shape and
byte range; a read goes from the file into the destination's memory with no tensor in
between, so loading never holds a second copy of the model.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from offload.errors import OffloadError

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER_BYTES = 100 * 2**20


class CheckpointError(OffloadError):
    """A checkpoint file is missing, truncated or not valid safetensors."""


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes are in a safetensors file."""

    path: Path
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    num_bytes: int


def read_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file, checked against the file's size."""
    try:
        size = path.stat().st_size
        with path.open("rb") as file:
            prefix = file.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path} is not a safetensors file (shorter than 8 bytes)")
            (header_bytes,) = struct.unpack("<Q", prefix)
            if header_bytes > min(_MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(
                    f"{path} is not a valid safetensors file (header length {header_bytes})"
                )
            header = json.loads(file.read(header_bytes))
    except OSError as error:
        raise CheckpointError(f"cannot read {path}: {error.strerror or error}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path} is not a valid safetensors file (bad header)") from None
    header.pop("__metadata__", None)
    start = 8 + header_bytes
    tensors = {}
    for name, entry in header.items():
        tensors[name] = _stored(path, name, entry, start, size)
    return tensors


def _stored(path: Path, name: str, entry: object, start: int, size: int) -> StoredTensor:
    try:
        dtype = DTYPES[entry["dtype"]]
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(x) for x in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry") from None
    expected = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if end - begin != expected or begin < 0:
        raise CheckpointError(
            f"{path}: tensor {name!r} has {end - begin} bytes, its shape needs {expected}"
        )
    if start + end > size:
        raise CheckpointError(f"{path} is truncated: tensor {name!r} ends past the end of the file")
    return StoredTensor(path, name, dtype, shape, start + begin, end - begin)


def read_into(stored: StoredTensor, destination: torch.Tensor) -> None:
    """Read the bytes of `stored` into `destination`, a contiguous host tensor of the
    same number of bytes (any dtype: the bytes are copied as they are)."""
    if destination.device.type != "cpu" or not destination.is_contiguous():
        raise ValueError("read_into needs a contiguous host tensor")
    num_bytes = destination.numel() * destination.element_size()
    if num_bytes != stored.num_bytes:
        raise ValueError(f"{stored.name}: {stored.num_bytes} bytes into a {num_bytes}-byte tensor")
    if num_bytes == 0:
        return
    view = memoryview(destination.reshape(-1).view(torch.uint8).numpy()).cast("B")
    descriptor = os.open(stored.path, os.O_RDONLY)
    try:
        done = 0
        while done < num_bytes:
            count = os.preadv(descriptor, [view[done:]], stored.offset + done)
            if count == 0:
                raise CheckpointError(f"{stored.path} is truncated while reading {stored.name!r}")
            done += count
    finally:
        os.close(descriptor)
