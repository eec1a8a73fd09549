"""The default model cut to its first `LAYERS` blocks (`gguf_files.first_layers_of`): its
own tokenizer, chat template, embedding, head and the real weights of those blocks, as
stored (Q4_1 blocks, a Q8_0 head). Exactness tests that compare two ways of running one
model (offloaded with resident, batched with alone, speculated with plain) hold the same
code to the same bits on it; its 4 blocks decode ~4x faster than the whole model's 30 on a
CPU here (10.6 against 45 ms a token, float32) and load in half the time. Tests of what the
model answers (its French capital, its tool calls) keep the whole model.

Written once per test session into the session's cache folder, under a lock (pytest-xdist
workers and the conftest's background conversion share it); its float32 conversion and
its stored layout are the library's own, cached there too (`model/sources.py`)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import gguf_files

from offload.model.cache_folder import cache_dir
from offload.model.default import gguf_path

LAYERS = 4


def short_gguf() -> Path:
    """The cut .gguf, written by the first process that asks."""
    folder = cache_dir() / "tests"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"SmolLM2-first-{LAYERS}.gguf"
    lock = os.open(folder / ".short.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (another process writing it: waited for)
        if not path.exists():
            staging = path.with_suffix(".partial")
            gguf_files.first_layers_of(gguf_path(), staging, LAYERS)
            staging.rename(path)
    finally:
        os.close(lock)
    return path


def prepare() -> None:
    """The cut file, its float32 folder and its stored layout made ahead of the tests
    (the conftest's background process): each under the library's own conversion lock."""
    from offload.model.sources import resolve_model
    from offload.probes.layout_choice import LayoutChooser

    path = short_gguf()
    resolve_model(path)
    resolve_model(path, quantization="gguf", layout_chooser=LayoutChooser)
