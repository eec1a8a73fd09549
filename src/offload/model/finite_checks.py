"""Which tensor of a checkpoint holds nan or inf: asked only after a forward's logits
came out non-finite (`engine.sampling`), to name the file's tensor instead of guessing
between a damaged checkpoint and an overflowing dtype. Quantized scales and .gguf blocks
are checked at load (`packed_checks`, `gguf_checks`); plain float tensors are not (a
full pass over every weight at each load would cost what a prefill costs)."""

from __future__ import annotations

from pathlib import Path

import torch

_ROWS_BYTES = 64 << 20  # a tensor is read this much at a time (memory stays bounded)


def non_finite_tensor(path: Path) -> tuple[str, str, int] | None:
    """The first float tensor of the safetensors files at `path` (a file or a folder)
    holding nan or inf: (file name, tensor name, how many values); None where every one is
    finite, or where there is nothing to read."""
    from safetensors import safe_open

    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    for file in files:
        if file.suffix != ".safetensors":
            continue
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a handle is not iterable)
                bad = _count(handle.get_slice(name))
                if bad:
                    return file.name, name, bad
    return None


def _count(part) -> int:
    """Non-finite values of one tensor, read a block of rows at a time."""
    dtype = part.get_dtype()
    if dtype not in ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"):
        return 0
    shape = part.get_shape()
    if not shape:
        return int((~torch.isfinite(part[...].float())).sum())
    row_bytes = max(1, int(torch.tensor(shape[1:]).prod()) if len(shape) > 1 else 1) * 4
    step = max(1, _ROWS_BYTES // row_bytes)
    bad = 0
    for start in range(0, shape[0], step):
        block = part[start : start + step]
        bad += int((~torch.isfinite(block.float())).sum())
    return bad
