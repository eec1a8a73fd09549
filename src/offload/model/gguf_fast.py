"""gguf's reader with its arrays read quickly: the same fields, parts and tensors.

gguf's `GGUFReader` reads every element of a metadata array through a slice and two
views of its memory map (`_get`), numpy's memmap class most of the cost: 2.1 s for the
default model's 49k tokens and 49k merges, at every conversion and every read of a
tokenizer (docs/benchmarks.md). `FastReader` reads a one-level array of strings or
numbers into the same parts (each element's own arrays, views of the same memory) with
one plain view of the map and a slice an element: 0.13 s for the same file. Everything else
(nested arrays, a file of the other byte order, the tensors) is gguf's own reading."""

from __future__ import annotations

import struct
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType


class FastReader(gguf.GGUFReader):
    """`gguf.GGUFReader`, its one-level arrays read at a slice an element."""

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list, list]:
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        count = self._get(orig_offs + 4, np.uint64)
        item = int(raw_itype[0])
        scalar = self.gguf_scalar_to_np.get(GGUFValueType(item)) if item in _TYPES else None
        if item != GGUFValueType.STRING and scalar is None:  # (arrays of arrays: gguf's)
            return super()._get_field_parts(orig_offs, raw_type)
        parts: list[Any] = [raw_itype, count]
        types = [GGUFValueType.ARRAY] + ([GGUFValueType(item)] if count[0] else [])
        offs = orig_offs + 12
        # (plain arrays over the map: numpy's memmap class costs ~3 us a slice)
        data = self.data.view(np.ndarray)
        if scalar is not None:
            whole = data[offs:].view(np.uint8)[: count[0] * np.dtype(scalar).itemsize]
            if len(whole) != count[0] * np.dtype(scalar).itemsize:
                raise ValueError("array runs past the end of the file")
            whole = whole.view(np.dtype(scalar).newbyteorder(self.byte_order))
            parts += [whole[i : i + 1] for i in range(len(whole))]
            return 12 + whole.nbytes, parts, list(range(2, len(parts))), types
        length = np.dtype(np.uint64).newbyteorder(self.byte_order)
        end = len(data)
        for _ in range(int(count[0])):
            if offs + 8 > end:
                raise ValueError("string array runs past the end of the file")
            (size,) = _U64.unpack_from(data, offs)
            if offs + 8 + size > end:
                raise ValueError("string runs past the end of the file")
            parts += [data[offs : offs + 8].view(length), data[offs + 8 : offs + 8 + size]]
            offs += 8 + size
        return offs - orig_offs, parts, list(range(3, len(parts), 2)), types


_TYPES = {int(t) for t in GGUFValueType}
_U64 = struct.Struct("<Q")
