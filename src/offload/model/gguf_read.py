"""A .gguf's header read without gguf's reader (`gguf_header.py` gives it checked): its
architecture, its numeric settings, the length of each of its arrays, and each tensor's
name, type, shape and byte range, past every other setting (the tokenizer's arrays
included) without building them. gguf's reader makes a numpy array of every token and
merge, slow and large for a 49k-token vocabulary, at every read (docs/benchmarks.md;
`gguf_header` is asked by every `LLM` of a .gguf; a conversion reads every tensor's range).

Every count and length is bounded by the bytes left in the file before it is used, so a
hostile header (2^62 array items, a 2^62-byte string) is refused in one pass over its
own bytes; what the values mean is checked in `gguf_checks.py`."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

from offload.errors import ModelError, shown

# Bytes of each scalar GGUF value type (8 is a string, 9 an array: read as they come).
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR_FORMS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?"}
_SCALAR_FORMS.update({10: "Q", 11: "q", 12: "d"})
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_MIN_ITEM_BYTES = {**_SCALAR_BYTES, _STRING: 8, _ARRAY: 12}  # (an empty string, array)
_DEFAULT_ALIGNMENT = 32
# Strings in all the arrays of a header: gguf's reader makes numpy arrays of each (a cost
# in time and memory per string: docs/benchmarks.md), so a file of 10^7 one-byte tokens
# would take minutes and GBs.
# The largest tokenizers hold about 0.5 million (Command R: 256k tokens, 253k merges).
MAX_STRINGS = 1 << 20
_MAX_DIMS = 4  # GGML_MAX_DIMS: ggml's tensors have at most 4 dimensions
_PLAIN = ("F32", "F16", "F64", "I8", "I16", "I32", "I64", "BF16")  # one value an element


@dataclass(frozen=True)
class HeaderTensor:
    """One tensor as the header describes it."""

    name: str
    kind: str  # GGUF type name ("Q4_0", "F32"; "type N" for a type gguf does not know)
    shape: tuple[int, ...]  # as numpy holds it: [rows, bytes per row] for blocks
    offset: int  # absolute, in the file
    num_bytes: int
    dims: tuple[int, ...] = ()  # as GGUF lists them (innermost first)


@dataclass
class Header:
    """What a .gguf's header says: its settings (numbers and the architecture; each
    array's item type and length) and its tensors."""

    num_bytes: int  # of the file
    arch: str | None = None
    alignment: int = _DEFAULT_ALIGNMENT
    numbers: dict[str, int | float] = field(default_factory=dict)
    arrays: dict[str, tuple[int, int]] = field(default_factory=dict)  # key: (item type, count)
    keys: set[str] = field(default_factory=set)
    tensors: list[HeaderTensor] = field(default_factory=list)


def read_header(source: Path) -> Header:
    """The header of the .gguf `source`; a count or length beyond the bytes left, a value
    type GGUF does not have or a key given twice is a ModelError naming it."""
    with source.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        cursor = _Cursor(data, source)
        header = Header(len(data))
        cursor.settings(header)
        infos = cursor.tensor_infos()
        start = -(-cursor.at // header.alignment) * header.alignment
    header.tensors = [
        _tensor(name, kind, dims, start + offset) for name, kind, dims, offset in infos
    ]
    return header


class _Cursor:
    """A cursor over a .gguf's header (its byte order taken from the version field)."""

    def __init__(self, data: mmap.mmap, source: Path):
        self.data, self.source = data, source
        self.order = "<" if struct.unpack_from("<I", data, 4)[0] <= 0xFFFF else ">"
        self.num_tensors, self.num_settings = self.unpack("QQ", 8)
        self.at = 24
        self.num_strings = 0  # in arrays so far

    def damaged(self, what: str) -> ModelError:
        return ModelError(f"{self.source} is damaged or truncated: {what}")

    def unpack(self, form: str, at: int) -> tuple:
        if at + struct.calcsize(self.order + form) > len(self.data):
            raise self.damaged(f"its header runs past the end of the file (at byte {at})")
        return struct.unpack_from(self.order + form, self.data, at)

    def need(self, count: int, item_bytes: int, what: str, unit: str = "items") -> None:
        """`count` items of at least `item_bytes` each must fit in the bytes left."""
        left = len(self.data) - self.at
        if count * item_bytes > left:
            raise self.damaged(f"{what} of {count} {unit}, more than its {left} bytes left hold")

    def string(self, what: str = "a string") -> bytes:
        (length,) = self.unpack("Q", self.at)
        self.at += 8
        self.need(length, 1, f"{what} has a length", "bytes")
        self.at += length
        return self.data[self.at - length : self.at]

    def text(self, what: str) -> str:
        raw = self.string(what)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            raise self.damaged(f"{what} {shown(raw)} is not UTF-8") from None

    def value_type(self, key: str) -> int:
        (kind,) = self.unpack("I", self.at)
        self.at += 4
        if kind not in _MIN_ITEM_BYTES:
            raise self.damaged(f"setting {key!r} has value type {kind}, not one GGUF has (0-12)")
        return kind

    def skip(self, kind: int, key: str) -> None:
        if kind == _STRING:
            self.string(f"a string of setting {key!r}")
        elif kind != _ARRAY:
            self.unpack(_SCALAR_FORMS[kind], self.at)  # (checks that it is in the file)
            self.at += _SCALAR_BYTES[kind]
        else:
            item, count = self.array(key)
            self.walk(item, count, key)

    def array(self, key: str) -> tuple[int, int]:
        item = self.value_type(key)
        (count,) = self.unpack("Q", self.at)
        self.at += 8
        self.need(count, _MIN_ITEM_BYTES[item], f"setting {key!r} is an array")
        self.num_strings += count if item == _STRING else 0
        if self.num_strings > MAX_STRINGS:
            raise ModelError(
                f"{self.source}: its settings' arrays hold more than {MAX_STRINGS} strings "
                f"(setting {key!r} has {count}); the largest tokenizers have about 0.5 million"
            )
        return item, count

    def walk(self, item: int, count: int, key: str) -> None:
        if item in _SCALAR_BYTES:
            self.at += count * _SCALAR_BYTES[item]
        else:
            for _ in range(count):
                self.skip(item, key)

    def settings(self, header: Header) -> None:
        """Each setting into `header`: numbers, the architecture, the alignment, arrays'
        lengths (each key once)."""
        self.need(self.num_settings, 8 + 4 + 1, "the header lists settings")
        for _ in range(self.num_settings):
            key = self.text("a setting's name")
            if key in header.keys:
                raise self.damaged(f"setting {key!r} is given twice")
            header.keys.add(key)
            kind = self.value_type(key)
            if kind in _SCALAR_FORMS:
                (header.numbers[key],) = self.unpack(_SCALAR_FORMS[kind], self.at)
                self.at += _SCALAR_BYTES[kind]
            elif kind == _STRING and key == "general.architecture":
                header.arch = self.text(f"setting {key!r}")
            elif kind == _ARRAY:
                header.arrays[key] = self.array(key)
                self.walk(*header.arrays[key], key)
            else:
                self.skip(kind, key)
            if key == "general.alignment":
                header.alignment = _alignment(self, kind, header.numbers.get(key))

    def tensor_infos(self) -> list[tuple[str, int, tuple[int, ...], int]]:
        """Each tensor's (name, type, dimensions as GGUF lists them, offset in the data)."""
        self.need(self.num_tensors, 8 + 4 + 4 + 8, "the header lists tensors")
        found, names = [], set()
        for _ in range(self.num_tensors):
            name = self.text("a tensor's name")
            if name in names:
                raise self.damaged(f"tensor {name!r} is listed twice")
            names.add(name)
            (count,) = self.unpack("I", self.at)
            if not 1 <= count <= _MAX_DIMS:
                raise ModelError(
                    f"{self.source}: tensor {name!r} has {count} dimensions; GGUF allows 1 to "
                    f"{_MAX_DIMS}"
                )
            dims = self.unpack(f"{count}Q", self.at + 4)
            kind, offset = self.unpack("IQ", self.at + 4 + 8 * count)
            self.at += 4 + 8 * count + 4 + 8
            found.append((name, kind, dims, offset))
        return found


def _alignment(cursor: _Cursor, kind: int, value: int | float | None) -> int:
    """general.alignment, as gguf's reader takes it: a uint32 power of two."""
    if kind != _UINT32 or not isinstance(value, int) or value <= 0 or value & (value - 1):
        raise ModelError(
            f"{cursor.source}: general.alignment={shown(value)} (value type {kind}); it must be "
            "a uint32 power of two"
        )
    return value


def _tensor(name: str, kind: int, dims: tuple[int, ...], offset: int) -> HeaderTensor:
    """A tensor's type name, numpy shape and bytes (gguf's `quant_shape_to_byte_shape`)."""
    import gguf

    try:
        quant = gguf.GGMLQuantizationType(kind)
    except ValueError:
        return HeaderTensor(name, f"type {kind}", tuple(reversed(dims)), offset, 0, dims)
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[quant]
    elements = 1
    for dim in dims:
        elements *= dim
    shape = list(reversed(dims))
    if quant.name not in _PLAIN and shape:
        shape[-1] = shape[-1] // block_size * block_bytes
    num_bytes = elements // block_size * block_bytes
    return HeaderTensor(name, quant.name, tuple(shape), offset, num_bytes, dims)
