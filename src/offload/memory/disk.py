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

from offload.errors import ModelError

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


class CheckpointError(ModelError):
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
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise CheckpointError(f"{path} is not a valid safetensors file (bad header)") from None
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{path} is not a valid safetensors file (its header is a JSON "
            f"{json_type(header)}, not an object of tensors)"
        )
    header.pop("__metadata__", None)
    start = 8 + header_bytes
    tensors = {}
    for name, entry in header.items():
        tensors[name] = _stored(path, name, entry, start, size)
    return tensors


def _stored(path: Path, name: str, entry: object, start: int, size: int) -> StoredTensor:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise CheckpointError(
            f"{where} has a malformed header entry (needs an object with dtype, shape and "
            f"data_offsets, got {json_type(entry)} {_short(entry)})"
        )
    dtype = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise CheckpointError(
            f"{where} has dtype {_short(entry['dtype'])}; supported: {', '.join(DTYPES)}"
        )
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not _naturals(shape):
        raise CheckpointError(
            f"{where} has shape {_short(shape)}; a shape is a list of non-negative integers"
        )
    if not _naturals(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise CheckpointError(
            f"{where} has data_offsets {_short(offsets)}; they must be [begin, end] with "
            "0 <= begin <= end"
        )
    begin, end = offsets
    expected = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if end - begin != expected:
        raise CheckpointError(
            f"{where} has {end - begin} bytes, its shape {shape} of {entry['dtype']} needs {expected}"
        )
    if start + end > size:
        raise CheckpointError(f"{path} is truncated: tensor {name!r} ends past the end of the file")
    return StoredTensor(path, name, dtype, tuple(shape), start + begin, end - begin)


def _naturals(value: object) -> bool:
    """A JSON list of non-negative integers (booleans are not integers here)."""
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    )


def json_type(value: object) -> str:
    """The JSON name of a decoded JSON value's type, for messages."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def _short(value: object, limit: int = 60) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
