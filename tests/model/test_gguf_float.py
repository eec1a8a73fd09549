"""A checkpoint saved by the float conversion is aligned in place: its tensor bytes begin
at a 64-byte boundary, the same tensors as before."""

import torch

from offload.model import gguf_float


def test_a_checkpoint_is_aligned_in_place_with_the_same_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = {"a": torch.randn(3, 16), "b": torch.arange(10, dtype=torch.int64)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    assert gguf_float.data_start(path) % 64 != 0  # (as safetensors writes it: 8-byte padding)
    gguf_float.align_safetensors(path)
    assert gguf_float.data_start(path) % 64 == 0
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[name], tensors[name]) for name in tensors)
