"""A planned .gguf (`gguf_plan.py`) written into its converted folder one tensor at a time:
each copied tensor's bytes are read from the .gguf with `pread` (no mapping whose touched
pages would stay in the process's memory), laid out, written and freed, so the conversion
holds one tensor's layouts at a time whatever the model's size. Referenced tensors are
only named (`memory/referenced.py`).

The free space is checked first, against the exact size of the file to write (its header
and every layout's bytes are known ahead) and a margin for the tokenizer's files; nothing
is written when it does not fit. Progress shows as a bar on a terminal, and as one line
when the conversion starts and one when it ends elsewhere (a log).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from offload.errors import ModelError
from offload.memory.host import trim_freed_memory
from offload.memory.safetensors import StoredTensor
from offload.memory.safetensors_writer import (
    SafetensorsWriter,
    TensorEntry,
    file_bytes,
    write_references,
)
from offload.model.gguf_plan import FLOATS, Planned, SourceTensor
from offload.quant.quantized import rows_in_hf_order
from offload.quant.traits import laid_out
from offload.sizes import format_bytes

MODEL_FILE = "model.safetensors"
SIDE_FILES_PER_SETTINGS_BYTE = 4  # config and tokenizer files, at most, per .gguf settings byte


def read_rows(descriptor: int, source: SourceTensor) -> torch.Tensor:
    """`source`'s bytes read from the open .gguf: uint8 [rows, bytes per row] for blocks,
    else its float values (a fresh, writable tensor)."""
    buffer = bytearray(source.num_bytes)
    view, done = memoryview(buffer), 0
    while done < source.num_bytes:
        count = os.preadv(descriptor, [view[done:]], source.offset + done)
        if count == 0:
            raise ValueError(f"the .gguf is truncated: {source.name} ends past its end")
        done += count
    dtype = FLOATS.get(source.kind, torch.uint8)
    return torch.frombuffer(buffer, dtype=dtype).reshape(source.shape)


class LazyRows:
    """A tensor's shape, and its bytes only when numpy asks for them (`LayoutChooser`
    reads only the first weight of each type and shape, to time it)."""

    def __init__(self, descriptor: int, source: SourceTensor):
        self.shape = source.shape
        self._descriptor, self._source = descriptor, source

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return read_rows(self._descriptor, self._source).numpy()

    def __getitem__(self, rows: slice) -> torch.Tensor:
        """The rows `rows` (a slice from the first row) read: uint8 [count, bytes]."""
        count = len(range(*rows.indices(self.shape[0])))
        assert rows.start in (None, 0) and rows.step in (None, 1), "reads a head of rows"
        row_bytes = self._source.num_bytes // self.shape[0]
        head = dataclasses.replace(
            self._source, shape=(count, *self.shape[1:]), num_bytes=count * row_bytes
        )
        return read_rows(self._descriptor, head)


def entries_to_write(planned: Sequence[Planned]) -> list[TensorEntry]:
    return [TensorEntry(*entry) for p in planned if not p.referenced for entry in p.entries]


def check_free_space(folder: Path, source: Path, planned: Sequence[Planned]) -> int:
    """The bytes the conversion writes into `folder`; a ModelError naming the folder, the
    bytes needed and free, and the ways out, where they do not fit."""
    settings_bytes = min((p.source.offset for p in planned), default=0)
    needed = file_bytes(entries_to_write(planned)) + SIDE_FILES_PER_SETTINGS_BYTE * settings_bytes
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise ModelError(
            f"{folder.parent} has {format_bytes(free)} free and {source.name} as stored needs "
            f"{format_bytes(needed)} there: free some space, or convert it into another "
            "folder (offload_folder= / --offload-folder, or OFFLOAD_CACHE_DIR)"
        )
    return needed


def write_planned(
    source: Path, out_dir: Path, planned: Sequence[Planned], progress: bool | None = None
) -> None:
    """`planned`'s copied tensors into `out_dir / MODEL_FILE`, in their order, and the
    referenced ones' byte ranges beside it. `progress`: a bar (default: on a terminal)."""
    copied = [p for p in planned if not p.referenced]
    referenced = {
        p.source.name: StoredTensor(
            source, p.source.name, FLOATS.get(p.source.kind, torch.uint8), p.source.shape,
            p.source.offset, p.source.num_bytes,
        )
        for p in planned
        if p.referenced
    }  # fmt: skip
    total = sum(p.source.num_bytes for p in copied)
    descriptor = os.open(source, os.O_RDONLY)
    try:
        with (
            SafetensorsWriter(out_dir / MODEL_FILE, entries_to_write(planned)) as writer,
            _progress(
                source, total, sum(t.num_bytes for t in referenced.values()), progress
            ) as bar,
        ):
            for item in copied:
                for name, tensor in _made(descriptor, item).items():
                    writer.write(name, tensor)
                # Each tensor's copies are freed in pieces malloc keeps: handed back after
                # each, a conversion peaks lower (docs/benchmarks.md).
                trim_freed_memory()
                bar(item.source.num_bytes)
    finally:
        os.close(descriptor)
    if referenced:  # (else the folder holds all it needs: the .gguf may go)
        write_references(out_dir, source, referenced)


def _made(descriptor: int, item: Planned) -> dict[str, torch.Tensor]:
    """The tensors one planned tensor becomes: its rows read, put in transformers' order,
    and laid out."""
    source = item.source
    rows = read_rows(descriptor, source)
    if source.heads:
        rows = rows_in_hf_order(rows, source.heads)
    if item.layout is None:
        return {source.name: rows}
    return laid_out(source.name, rows, source.kind, item.layout)


@contextlib.contextmanager
def _progress(source: Path, total: int, in_place: int, show: bool | None) -> Iterator:
    """A callback counting bytes laid out: a tqdm bar on a terminal (`show`), else a line
    on stderr at the start and one at the end."""
    if show is None:
        show = sys.stderr.isatty()
    what = f"offload: {source.name} as stored"
    started = time.perf_counter()
    if show:
        from tqdm import tqdm

        with tqdm(
            total=total, desc=what, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr
        ) as bar:
            yield bar.update
        return
    print(
        f"{what}: {format_bytes(total)} to lay out, {format_bytes(in_place)} read from the "
        ".gguf in place...",
        file=sys.stderr,
        flush=True,
    )
    yield lambda _: None
    print(f"{what}: ready in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
