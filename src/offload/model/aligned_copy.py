"""A safetensors checkpoint rewritten with its matrices 64-byte aligned in their files, so
that the disk tier can compute on a mapping of them (`disk_io="mmap"`, what "auto" picks
on a warm cache): the safetensors library writes tensors 8-byte aligned, and a mapped
matrix off a 64-byte boundary sums differently from the resident one, so such a file is
otherwise read through the page cache, a copy per token (4x slower measured on a 2.7 GiB
bf16 model, docs/benchmarks.md). `sources.py` makes the copy once per version of the
folder, only where a disk tier would map it."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from offload.memory.disk_layout import MAP_ALIGN, maps_exactly
from offload.memory.safetensors import StoredTensor
from offload.memory.safetensors_writer import SafetensorsWriter, TensorEntry
from offload.sizes import format_bytes


def misaligned_matrices(stored: Mapping[str, StoredTensor]) -> int:
    """How many of a checkpoint's tensors (`checkpoint_tensors`) cannot be mapped exactly."""
    return sum(not maps_exactly(t.offset, len(t.shape)) for t in stored.values())


def write_aligned(folder: Path, stored: Mapping[str, StoredTensor], out: Path) -> None:
    """Each safetensors file of the checkpoint in `folder` (its tensors `stored`) into
    `out` under its own name, its tensors in their order save that those whose size is not
    a multiple of `MAP_ALIGN` go last (the format allows no gaps), read and written one at
    a time; the other files copied."""
    from safetensors import safe_open

    files = sorted({t.path for t in stored.values()})
    what = f"offload: an aligned copy of {folder.name} for mapping"
    total = format_bytes(sum(path.stat().st_size for path in files))
    print(f"{what}: {total} to write...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    for source in files:
        held = sorted((t for t in stored.values() if t.path == source), key=lambda t: t.offset)
        entries = [TensorEntry(t.name, t.dtype, tuple(t.shape)) for t in held]
        entries.sort(key=lambda entry: entry.num_bytes % MAP_ALIGN != 0)  # (a stable sort)
        target = out / source.name
        with (
            safe_open(source, framework="pt") as reader,
            SafetensorsWriter(target, entries) as writer,
        ):
            for entry in entries:
                writer.write(entry.name, reader.get_tensor(entry.name))
    for extra in folder.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors":
            shutil.copy2(extra, out / extra.name)
    print(f"{what}: ready in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
