"""safetensors checkpoints (one file, or the shards an index names) read by byte range,
straight into the tensor that will hold the data.

The header (8-byte little-endian length, then JSON) gives each tensor's dtype, shape and
byte range; a read goes from the file into the destination's memory with no tensor in
between, so loading never holds a second copy of the model. A folder may also take
tensors from another file by byte range (`REFERENCES`: a .gguf's blocks, not copied).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

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
# A folder's tensors that are read from another file by byte range instead of a copy (a
# .gguf's blocks): the file's path, size and modification time, and each tensor's dtype,
# shape and offset there. A file that changed since is refused (its bytes may no longer be
# the tensors named; a conversion of the new file is keyed anew).
REFERENCES = "referenced_tensors.json"
_MAX_HEADER_BYTES = 100 * 2**20
_MAX_TENSOR_BYTES = 2**63 - 1  # torch counts bytes in int64; the safetensors library in usize


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
    """The tensors of one safetensors file, checked as strictly as the safetensors library
    checks them: each entry's bytes match its shape and dtype, and the tensors, in the
    order of their offsets, tile the data section exactly (no gap, no overlap, nothing
    after the last one)."""
    try:
        size = path.stat().st_size
        with path.open("rb", buffering=0) as file:
            # No read-ahead: only the header's pages enter the page cache, not the weights.
            os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
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
    except (ValueError, RecursionError):  # bad JSON or UTF-8, an int of over 4300 digits
        raise CheckpointError(f"{path} is not a valid safetensors file (bad header)") from None
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{path} is not a valid safetensors file (its header is a JSON "
            f"{json_type(header)}, not an object of tensors)"
        )
    _check_metadata(path, header.pop("__metadata__", {}))
    start = 8 + header_bytes
    tensors = {}
    for name, entry in header.items():
        tensors[name] = _stored(path, name, entry, start, size)
    _check_tiling(path, tensors, start, size)
    return tensors


def _check_metadata(path: Path, metadata: object) -> None:
    """`__metadata__` is free text: an object of strings, as the library requires."""
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(
            f"{path} is not a valid safetensors file (__metadata__ must be an object of "
            f"strings, got {_short(metadata)})"
        )


def _check_tiling(path: Path, tensors: dict[str, StoredTensor], start: int, size: int) -> None:
    """Tensors sorted by their byte ranges must follow each other from the start of the
    data section to the end of the file: overlapping ranges would give two tensors the
    same bytes, and gaps or trailing bytes are data no tensor accounts for."""
    end = start
    for stored in sorted(tensors.values(), key=lambda t: (t.offset, t.offset + t.num_bytes)):
        if stored.offset != end:
            problem = "overlaps the tensor before it" if stored.offset < end else "leaves a gap"
            raise CheckpointError(
                f"{path}: tensor {stored.name!r} begins at data offset {stored.offset - start} "
                f"but the tensors before it end at {end - start}: it {problem}; tensors must "
                "cover the data section in order, without gaps or overlaps"
            )
        end = stored.offset + stored.num_bytes
    if end != size:
        raise CheckpointError(
            f"{path}: the tensors cover {end - start} bytes of data but the file has "
            f"{size - start} after its header; a safetensors file ends with its last tensor"
        )


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
    expected = _byte_count(shape, torch.empty((), dtype=dtype).element_size())
    if expected is None:
        raise CheckpointError(
            f"{where} has shape {_short(shape)}, more than {_MAX_TENSOR_BYTES} bytes of "
            f"{entry['dtype']}: no tensor is that large"
        )
    if end - begin != expected:
        raise CheckpointError(
            f"{where} has {end - begin} bytes, its shape {shape} of {entry['dtype']} needs {expected}"
        )
    if start + end > size:
        raise CheckpointError(f"{path} is truncated: tensor {name!r} ends past the end of the file")
    return StoredTensor(path, name, dtype, tuple(shape), start + begin, end - begin)


def _byte_count(shape: list[int], element_bytes: int) -> int | None:
    """The bytes of a tensor of `shape`, or None past `_MAX_TENSOR_BYTES`. Stops at the
    first partial product past the limit, as the library does: a shape of many huge
    dimensions costs no bignum arithmetic."""
    count = element_bytes
    for dimension in shape:
        if dimension > _MAX_TENSOR_BYTES:
            return None
        count *= dimension
        if count > _MAX_TENSOR_BYTES:
            return None
    return count


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


def read_into(stored: StoredTensor, destination: torch.Tensor, drop_cache: bool = False) -> None:
    """Read the bytes of `stored` into `destination`, a contiguous host tensor of the
    same number of bytes (any dtype: the bytes are copied as they are). `drop_cache`:
    then drop them from the page cache (the destination holds them now)."""
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
        if drop_cache:  # whole pages: the kernel keeps a page the range only touches
            start = stored.offset // 4096 * 4096
            end = -(-(stored.offset + num_bytes) // 4096) * 4096
            os.posix_fadvise(descriptor, start, end - start, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)


def checkpoint_tensors(path: Path) -> dict[str, StoredTensor]:
    """Every tensor of the checkpoint in `path`: one `model.safetensors`, or the shards
    that `model.safetensors.index.json` names, and those it takes from another file by
    byte range (`REFERENCES`: a .gguf's blocks)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = _shard_files(index)
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{path} has no model.safetensors or model.safetensors.index.json")
    tensors: dict[str, StoredTensor] = {}
    for name in files:
        for key, entry in read_header(path / name).items():
            if key in tensors:
                raise CheckpointError(
                    f"{path}: tensor {key!r} is in both {tensors[key].path.name} and {name}; "
                    "each tensor must be in one shard"
                )
            tensors[key] = entry
    for key, entry in referenced_tensors(path).items():
        if key in tensors:
            raise CheckpointError(
                f"{path}: tensor {key!r} is in both {tensors[key].path.name} and {REFERENCES}"
            )
        tensors[key] = entry
    return tensors


def _shard_files(index: Path) -> list[str]:
    """The shard files an index names, each a relative path inside the model folder."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError, IndexError, RecursionError):
        weight_map = None
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f"{index} is not a valid safetensors index (it must be a JSON object whose "
            '"weight_map" maps tensor names to shard files)'
        )
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name:
            raise CheckpointError(
                f"{index}: the shard of tensor {key!r} must be a file name, got {json.dumps(name)}"
            )
        if PurePosixPath(name).is_absolute() or ".." in PurePosixPath(name).parts:
            raise CheckpointError(
                f"{index}: shard {name!r} of tensor {key!r} is outside the model folder; "
                "shards must be named relative to the folder, without '..'"
            )
    return sorted(set(weight_map.values()))


# -- tensors a folder takes from another file ------------------------------------


def referenced_files(folder: Path) -> list[Path]:
    """The other file `folder` takes tensors from (a .gguf), where it names one: with its
    safetensors files, what a probe of the checkpoint's disk reads."""
    return sorted({stored.path for stored in referenced_tensors(folder).values()})


def referenced_tensors(folder: Path) -> dict[str, StoredTensor]:
    """The tensors `folder` takes from another file (none without `REFERENCES`), checked
    against that file as it is now."""
    path = folder / REFERENCES
    if not path.is_file():
        return {}
    try:
        document = json.loads(path.read_text())
        source = Path(document["file"])
        size, mtime_ns, entries = document["size"], document["mtime_ns"], document["tensors"]
        tensors = {name: _referenced(source, name, entry) for name, entry in entries.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
        raise CheckpointError(f"{path} is damaged ({type(error).__name__}: {error})") from None
    _check_source(folder, source, size, mtime_ns, tensors)
    return tensors


def _referenced(source: Path, name: str, entry: dict) -> StoredTensor:
    dtype, shape, offset = DTYPES[entry["dtype"]], tuple(entry["shape"]), entry["offset"]
    if not all(isinstance(v, int) and v >= 0 for v in (*shape, offset)):
        raise ValueError(f"{name}: shape {shape} and offset {offset} must be naturals")
    num_bytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return StoredTensor(source, name, dtype, shape, offset, num_bytes)


def _check_source(
    folder: Path, source: Path, size: int, mtime_ns: int, tensors: Mapping[str, StoredTensor]
) -> None:
    """The file the tensors are in is still the one the folder was made from."""
    try:
        stat = os.stat(source)
    except OSError as error:
        problem = f"cannot be read ({error.strerror or error})"
    else:
        problem = None
        if stat.st_size != size:
            problem = f"changed size ({size} -> {stat.st_size} bytes)"
        elif stat.st_mtime_ns != mtime_ns:
            problem = "was modified"
    if problem is None:
        end = max((t.offset + t.num_bytes for t in tensors.values()), default=0)
        if end > size:
            problem = f"is shorter ({size} bytes) than the tensors named in it ({end})"
    if problem is not None:
        raise CheckpointError(
            f"{folder} reads {len(tensors)} tensors from {source}, which {problem} since the "
            "folder was made: give the .gguf itself as the model (it is converted again), "
            "or remove the folder"
        )
