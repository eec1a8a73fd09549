"""safetensors headers are checked as strictly as the safetensors library checks them:
the library itself is the oracle for every crafted file here."""

import json
import struct
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from offload.memory.safetensors import CheckpointError, read_header, read_into


def _write(path, header, data=b""):
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
    return path


def _f32(begin, end, shape=None):
    shape = [(end - begin) // 4] if shape is None else shape
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


def _library_reads(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as file:
        return {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118


def _ours(path) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, stored in read_header(path).items():
        tensors[name] = torch.empty(stored.shape, dtype=stored.dtype)
        read_into(stored, tensors[name])
    return tensors


def _same(left, right):
    assert left.keys() == right.keys()
    for name in left:
        assert left[name].dtype == right[name].dtype and torch.equal(left[name], right[name])


def test_files_written_by_the_library_load(tmp_path):
    tensors = {
        "weight": torch.randn(3, 5),
        "half": torch.randn(7, dtype=torch.float16),
        "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "flags": torch.tensor([True, False, True]),
        "empty": torch.empty(0),
        "empty-rows": torch.empty(4, 0, dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5),
    }
    path = tmp_path / "saved.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    _same(_ours(path), tensors)
    _same(_ours(path), _library_reads(path))


VALID = {
    "listed-out-of-order": ({"b": _f32(16, 32), "a": _f32(0, 16)}, 32),
    "zero-size-first-middle-last": (
        {"z0": _f32(0, 0), "a": _f32(0, 8), "z1": _f32(8, 8), "b": _f32(8, 16), "z2": _f32(16, 16)},
        16,
    ),
    "only-zero-size": ({"z": _f32(0, 0, [0, 3])}, 0),
    "no-tensors": ({}, 0),
    "metadata": ({"__metadata__": {"format": "pt"}, "a": _f32(0, 8)}, 8),
}


@pytest.mark.parametrize(("header", "data_bytes"), VALID.values(), ids=VALID.keys())
def test_what_the_library_accepts_loads(tmp_path, header, data_bytes):
    data = bytes(range(256)) * 4
    path = _write(tmp_path / "ok.safetensors", header, data[:data_bytes])
    _same(_ours(path), _library_reads(path))


INVALID = {
    "overlap": ({"a": _f32(0, 16), "b": _f32(8, 24)}, 24, "'b' begins at data offset 8 but"),
    "same-bytes-twice": ({"a": _f32(0, 16), "b": _f32(0, 16)}, 16, "overlaps the tensor before"),
    "gap": ({"a": _f32(0, 16), "b": _f32(20, 36)}, 36, "leaves a gap"),
    "not-from-zero": ({"a": _f32(8, 24)}, 24, "'a' begins at data offset 8"),
    "trailing-bytes": ({"a": _f32(0, 16)}, 20, "cover 16 bytes of data but the file has 20"),
    "data-without-tensors": ({}, 4, "cover 0 bytes of data but the file has 4"),
    "dimension-past-u64": ({"a": _f32(0, 0, [2**70])}, 0, "no tensor is that large"),
    "product-past-u64": ({"a": _f32(0, 0, [2**32, 2**32])}, 0, "no tensor is that large"),
    "overflow-before-a-zero": ({"a": _f32(0, 0, [2**40, 2**40, 0])}, 0, "that large"),
    "metadata-not-strings": ({"__metadata__": {"n": 1}, "a": _f32(0, 8)}, 8, "__metadata__"),
    "metadata-not-object": ({"__metadata__": [], "a": _f32(0, 8)}, 8, "__metadata__ must be"),
}


@pytest.mark.parametrize(("header", "data_bytes", "needle"), INVALID.values(), ids=INVALID.keys())
def test_what_the_library_refuses_is_one_checkpoint_error(tmp_path, header, data_bytes, needle):
    path = _write(tmp_path / "bad.safetensors", header, bytes(data_bytes))
    with pytest.raises(Exception):  # noqa: B017 (the library's error types vary by version)
        _library_reads(path)
    with pytest.raises(CheckpointError) as info:
        read_header(path)
    message = str(info.value)
    assert message.startswith(str(path)) and needle in message, message
    assert "\n" not in message


def test_a_shape_of_many_huge_dimensions_is_refused_at_once(tmp_path):
    # The product would be a number of millions of digits: refused at its second factor.
    path = _write(tmp_path / "huge.safetensors", {"a": _f32(0, 0, [2**62] * 200_000)})
    started = time.perf_counter()
    with pytest.raises(CheckpointError, match="no tensor is that large"):
        read_header(path)
    assert time.perf_counter() - started < 1


def test_an_integer_too_long_for_python_is_a_bad_header(tmp_path):
    encoded = b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 0]}}'
    path = tmp_path / "digits.safetensors"
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded)
    with pytest.raises(CheckpointError, match="is not a valid safetensors file"):
        read_header(path)
