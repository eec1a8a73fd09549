"""`gguf_fast.FastReader` gives gguf's own reader's fields (each part's dtype, shape and
values, the indices, the types) and tensors: on the shipped file, and on files of every
value type, empty arrays, empty and non-ASCII strings, arrays of arrays and the other byte
order written by gguf's own writer."""

import struct

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload.model.gguf_fast import FastReader


def _assert_same(path) -> None:
    theirs, ours = gguf.GGUFReader(path), FastReader(path)
    assert list(theirs.fields) == list(ours.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.name, mine.data, mine.types) == (
            field.offset, field.name, field.data, field.types,
        ), name  # fmt: skip
        assert len(mine.parts) == len(field.parts), name
        for a, b in zip(field.parts, mine.parts, strict=True):
            assert (a.dtype, a.shape) == (b.dtype, b.shape) and np.array_equal(a, b), name
        assert mine.contents() == field.contents(), name
    assert [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in theirs.tensors
    ]


def test_the_shipped_files_fields_and_tensors(short_gguf):
    _assert_same(short_gguf)  # (the default model's tokenizer, chat template and blocks)


_NUMBERS = {
    gguf.GGUFValueType.UINT8: st.integers(0, 255),
    gguf.GGUFValueType.INT8: st.integers(-128, 127),
    gguf.GGUFValueType.UINT16: st.integers(0, 2**16 - 1),
    gguf.GGUFValueType.INT16: st.integers(-(2**15), 2**15 - 1),
    gguf.GGUFValueType.UINT32: st.integers(0, 2**32 - 1),
    gguf.GGUFValueType.INT32: st.integers(-(2**31), 2**31 - 1),
    gguf.GGUFValueType.UINT64: st.integers(0, 2**64 - 1),
    gguf.GGUFValueType.INT64: st.integers(-(2**63), 2**63 - 1),
    gguf.GGUFValueType.FLOAT32: st.floats(width=32, allow_nan=False),
    gguf.GGUFValueType.FLOAT64: st.floats(allow_nan=False),
    gguf.GGUFValueType.BOOL: st.booleans(),
}
_STRINGS = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)


@st.composite
def _settings(draw):
    kinds = [*_NUMBERS, gguf.GGUFValueType.STRING, "strings", "numbers", "nested"]
    out = []
    for i, kind in enumerate(draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=8))):
        if kind == gguf.GGUFValueType.STRING:
            out.append((f"k{i}", draw(_STRINGS), kind))
        elif kind == "strings":
            strings = draw(st.lists(_STRINGS, min_size=1, max_size=6))  # (see below: empty)
            out.append((f"k{i}", strings, gguf.GGUFValueType.ARRAY))
        elif kind == "numbers":
            number = draw(st.sampled_from(list(_NUMBERS)))
            values = draw(st.lists(_NUMBERS[number], min_size=1, max_size=6))
            out.append((f"k{i}", values, gguf.GGUFValueType.ARRAY, number))
        elif kind == "nested":
            inner = st.lists(st.integers(0, 9), min_size=1, max_size=3)
            values = draw(st.lists(inner, min_size=1, max_size=3))
            out.append((f"k{i}", values, gguf.GGUFValueType.ARRAY))
        else:
            out.append((f"k{i}", draw(_NUMBERS[kind]), kind))
    return out


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=_settings(), big=st.booleans())
def test_written_files_of_every_value_type(tmp_path, values, big):
    path = tmp_path / "f.gguf"
    endian = gguf.GGUFEndian.BIG if big else gguf.GGUFEndian.LITTLE
    writer = gguf.GGUFWriter(path, "llama", endianess=endian)
    for key, value, kind, *sub in values:
        writer.add_key_value(key, value, kind, sub_type=sub[0] if sub else None)
    writer.add_tensor("t", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _assert_same(path)


def test_empty_arrays(tmp_path):
    """gguf's writer writes no empty array; other writers do (the header by hand)."""
    path = tmp_path / "empty.gguf"
    string, uint32, array = (int(gguf.GGUFValueType[n]) for n in ("STRING", "UINT32", "ARRAY"))
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 3)
    for key, item in (("a", string), ("b", uint32), ("c", string)):
        data += struct.pack("<Q", len(key)) + key.encode() + struct.pack("<IIQ", array, item, 0)
    path.write_bytes(data + bytes(32))
    _assert_same(path)
    assert FastReader(path).fields["b"].contents() == []


def test_an_array_past_the_end_of_the_file_is_an_error(short_gguf, tmp_path):
    """A file cut inside its token strings: an error, never fewer tokens."""
    data = short_gguf.read_bytes()
    reader = gguf.GGUFReader(short_gguf)
    tokens = reader.fields["tokenizer.ggml.tokens"]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: tokens.offset + 4000])
    with pytest.raises(ValueError, match="past the end"):
        FastReader(cut)
