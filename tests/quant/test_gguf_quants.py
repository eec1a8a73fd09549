"""GGUF's quantized blocks read with torch equal the `gguf` package's reference
dequantization bit for bit: on random blocks of every type, and on every tensor of the
default model's GGUF file."""

import gguf
import numpy as np
import pytest
import torch

from offload.errors import ModelError
from offload.model.default import gguf_path
from offload.model.gguf_fast import FastReader
from offload.quant.gguf_quants import EIGHT_BIT_GROUPS, FORMATS, dequantize
from offload.quant.layouts import pack_q8, q8_values

# Where each type keeps its fp16 fields (the rest of a block is packed integers).
F16_AT = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "Q2_K": [80, 82], "Q3_K": [108],
}  # fmt: skip


def _random_blocks(type_name: str, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Random bytes, with finite random fp16 scales (a nan scale would not compare)."""
    rng = np.random.default_rng(seed)
    size = FORMATS[type_name].block_bytes
    data = rng.integers(0, 256, size=(rows * blocks_per_row, size), dtype=np.uint8)
    for at in F16_AT[type_name]:
        scales = rng.normal(0, 0.05, size=rows * blocks_per_row).astype(np.float16)
        data[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, blocks_per_row * size)


@pytest.mark.parametrize("type_name", list(FORMATS))
@pytest.mark.parametrize("seed", [0, 1])
def test_each_type_equals_the_reference_bit_for_bit(type_name, seed):
    data = _random_blocks(type_name, rows=6, blocks_per_row=3, seed=seed)
    expected = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name])
    got = dequantize(torch.from_numpy(data), type_name)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(expected)))


@pytest.mark.parametrize("type_name", list(EIGHT_BIT_GROUPS))
def test_the_cpus_8_bit_layout_holds_the_reference_values_bit_for_bit(type_name):
    """Q8_0, Q5_0, Q5_1, Q5_K and Q6_K kept on a CPU as int8 by block column with their
    scales (and offsets): the values they give are the reference's, bit for bit, and the
    kept bytes are at most twice the file's."""
    data = _random_blocks(type_name, rows=6, blocks_per_row=3, seed=2)
    expected = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name])
    kept = pack_q8(torch.from_numpy(data), type_name)
    group, has_offsets = EIGHT_BIT_GROUPS[type_name]
    assert kept[0].dtype == torch.int8 and kept[0].shape[2] == group
    assert (kept[2] is not None) == has_offsets
    got = q8_values(*kept)
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(expected)))
    kept_bytes = sum(t.numel() * t.element_size() for t in kept if t is not None)
    assert kept_bytes <= 2 * data.nbytes


def test_the_default_models_tensors_equal_the_reference():
    """The first tensor of each type in the file, and a whole decoder layer."""
    reader = FastReader(gguf_path())
    seen = set()
    for tensor in reader.tensors:
        name = tensor.tensor_type.name
        if name in seen and not tensor.name.startswith("blk.0."):
            continue
        seen.add(name)
        data = np.array(tensor.data[:1024])  # (the embedding's first rows: enough)
        expected = gguf.quants.dequantize(data, tensor.tensor_type)
        got = dequantize(torch.from_numpy(data).view(torch.uint8), name)
        assert torch.equal(got.reshape(expected.shape), torch.from_numpy(expected)), tensor.name
    assert {"Q4_1", "Q8_0", "F32"} <= seen


def test_a_type_not_read_and_a_partial_block_are_refused():
    with pytest.raises(ModelError, match="GGUF type IQ2_XS is not read yet; these are: F32"):
        dequantize(torch.zeros(10, dtype=torch.uint8), "IQ2_XS")
    with pytest.raises(ModelError, match="whole blocks of 20 bytes; got 30 bytes"):
        dequantize(torch.zeros(2, 30, dtype=torch.uint8), "Q4_1")
