"""A .gguf's header read without gguf's reader: its architecture, and each tensor's name,
type, shape and byte range, past every other setting (the tokenizer's arrays included)
without building them. gguf's reader makes a numpy array of every token and merge: ~2 s
and ~160 MB for a 49k-token vocabulary, at every read (`gguf_header` is asked by every
`LLM` of a .gguf; a conversion reads every tensor's range)."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

# Bytes of each scalar GGUF value type (8 is a string, 9 an array: read as they come).
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_UNSIGNED = {0: "B", 2: "H", 4: "I", 10: "Q"}  # (the types general.alignment may have)
_DEFAULT_ALIGNMENT = 32
_PLAIN = ("F32", "F16", "F64", "I8", "I16", "I32", "I64", "BF16")  # one value an element


@dataclass(frozen=True)
class HeaderTensor:
    """One tensor as the header describes it."""

    name: str
    kind: str  # GGUF type name ("Q4_0", "F32"; "type N" for a type gguf does not know)
    shape: tuple[int, ...]  # as numpy holds it: [rows, bytes per row] for blocks
    offset: int  # absolute, in the file
    num_bytes: int


def gguf_header(source: Path) -> tuple[str | None, list[tuple[str, str]]]:
    """A .gguf's architecture and its tensors' (name, type name). The counts are checked
    against the file's size first (`check_gguf_header`); a header that runs past the
    file's end is a `struct.error`."""
    arch, tensors = gguf_tensors(source)
    return arch, [(tensor.name, tensor.kind) for tensor in tensors]


def gguf_tensors(source: Path) -> tuple[str | None, list[HeaderTensor]]:
    """A .gguf's architecture and its tensors, as gguf's reader finds them (a tensor whose
    bytes run past the end of the file is a ValueError)."""
    from offload.model.default import check_gguf_header

    check_gguf_header(source)
    with source.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        header = _Header(data)
        arch, alignment = header.settings()
        infos = header.tensor_infos()
        start = -(-header.at // alignment) * alignment
        tensors = [_tensor(name, kind, dims, start + offset) for name, kind, dims, offset in infos]
        size = len(data)
    for tensor in tensors:
        if tensor.offset + tensor.num_bytes > size:
            raise ValueError(f"{source} is truncated: {tensor.name} ends past its end")
    return arch, tensors


class _Header:
    """A cursor over a .gguf's header (its byte order taken from the version field)."""

    def __init__(self, data: mmap.mmap):
        self.data = data
        self.order = "<" if struct.unpack_from("<I", data, 4)[0] <= 0xFFFF else ">"
        self.num_tensors, self.num_settings = self.unpack("QQ", 8)
        self.at = 24

    def unpack(self, form: str, at: int) -> tuple:
        return struct.unpack_from(self.order + form, self.data, at)

    def string(self) -> bytes:
        (length,) = self.unpack("Q", self.at)
        if self.at + 8 + length > len(self.data):
            raise struct.error("a string runs past the end of the file")
        self.at += 8 + length
        return self.data[self.at - length : self.at]

    def skip(self, kind: int) -> None:
        if kind == 8:
            self.string()
        elif kind != 9:
            self.at += _SCALAR_BYTES[kind]
        else:
            item, count = self.unpack("IQ", self.at)
            self.at += 12
            if item in _SCALAR_BYTES:
                self.at += count * _SCALAR_BYTES[item]
            else:
                for _ in range(count):
                    self.skip(item)

    def settings(self) -> tuple[str | None, int]:
        """The architecture and the tensors' alignment; past every other setting."""
        arch, alignment = None, _DEFAULT_ALIGNMENT
        for _ in range(self.num_settings):
            key = self.string()
            (kind,) = self.unpack("I", self.at)
            self.at += 4
            if key == b"general.architecture" and kind == 8:
                arch = self.string().decode()
            elif key == b"general.alignment" and kind in _UNSIGNED:
                (alignment,) = self.unpack(_UNSIGNED[kind], self.at)
                self.skip(kind)
            else:
                self.skip(kind)
        return arch, alignment or _DEFAULT_ALIGNMENT

    def tensor_infos(self) -> list[tuple[str, int, tuple[int, ...], int]]:
        """Each tensor's (name, type, dimensions as GGUF lists them, offset in the data)."""
        found = []
        for _ in range(self.num_tensors):
            name = self.string().decode()
            (count,) = self.unpack("I", self.at)
            dims = self.unpack(f"{count}Q", self.at + 4)
            kind, offset = self.unpack("IQ", self.at + 4 + 8 * count)
            self.at += 4 + 8 * count + 4 + 8
            found.append((name, kind, dims, offset))
        return found


def _tensor(name: str, kind: int, dims: tuple[int, ...], offset: int) -> HeaderTensor:
    """A tensor's type name, numpy shape and bytes (gguf's `quant_shape_to_byte_shape`)."""
    import gguf

    try:
        quant = gguf.GGMLQuantizationType(kind)
    except ValueError:
        return HeaderTensor(name, f"type {kind}", tuple(reversed(dims)), offset, 0)
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[quant]
    elements = 1
    for dim in dims:
        elements *= dim
    shape = list(reversed(dims))
    if quant.name not in _PLAIN and shape:
        shape[-1] = shape[-1] // block_size * block_bytes
    return HeaderTensor(
        name, quant.name, tuple(shape), offset, elements // block_size * block_bytes
    )
