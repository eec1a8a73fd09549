"""The fixed overhead of a process that runs a model: the memory a budget (`cpu_memory_gb`,
B) does not cover, so that its peak RSS stays within B + this (docs/guide.md, "Memory").

B holds what the run chooses the size of: the layer stack's weights in RAM (kept layers,
slots, pages of mapped checkpoint files that a forward touches), the KV cache and a step's
activations. The rest is fixed whatever B is: the process itself (Python, torch,
transformers and offload imported, the model built empty), the parameters outside the
layer stack (embedding, final norm, head: every step reads them, so they stay in RAM),
the tokenizer, and on a CPU whose decode steps compile, the compiler: inductor's modules,
graphs and the code it generates stay in the process once a step has compiled (a later run
loads the kept step instead, and stays below). A pure function of the built model, the
tokenizer's files and whether steps compile.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import nn

from offload.offloader.layers import find_layer_stacks
from offload.sizes import GIB, parameter_bytes

# RSS of a process that has imported torch, transformers and offload and built the model
# on the meta device, before any weight is read, with `offload serve`'s HTTP stack, as
# measured (docs/benchmarks.md), rounded up.
PROCESS_BASELINE_BYTES = 384 * 2**20
# A loaded tokenizer's RSS per byte of its files, as measured on SmolLM2's once loaded
# and used (docs/benchmarks.md), rounded up.
TOKENIZER_BYTES_PER_FILE_BYTE = 20
# What a process that compiles its CPU decode steps keeps beside an eager one's peak
# (inductor imported, the traced graphs, generated code), as measured for the models of
# benchmarks/scale.py (docs/benchmarks.md, "Issue 47 closed out, batch invariance
# (2026-11-29, twenty-fifth session)"), rounded up.
COMPILER_BYTES = 256 * 2**20
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
)


@dataclass(frozen=True)
class FixedOverhead:
    """The memory a budget does not cover, by part (bytes)."""

    process_bytes: int
    outside_stack_bytes: int  # parameters outside the layer stack, in the run's dtype
    tokenizer_bytes: int
    compiler_bytes: int = 0  # on a CPU whose decode steps compile in the process

    @property
    def total_bytes(self) -> int:
        return (
            self.process_bytes
            + self.outside_stack_bytes
            + self.tokenizer_bytes
            + self.compiler_bytes
        )

    def describe(self) -> str:
        """E.g. "0.84 GiB (process 0.38, outside the layer stack 0.38, tokenizer 0.07)",
        with ", compiler 0.25" where steps compile."""
        compiler = f", compiler {self.compiler_bytes / GIB:.2f}" if self.compiler_bytes else ""
        return (
            f"{self.total_bytes / GIB:.2f} GiB (process {self.process_bytes / GIB:.2f}, "
            f"outside the layer stack {self.outside_stack_bytes / GIB:.2f}, "
            f"tokenizer {self.tokenizer_bytes / GIB:.2f}{compiler})"
        )


def fixed_overhead(
    model: nn.Module, tokenizer_folder: Path | None = None, *, compiles: bool = False
) -> FixedOverhead:
    """The fixed overhead of running `model` (built, on the meta device or loaded) with
    the tokenizer in `tokenizer_folder` (None: no tokenizer counted); `compiles`: its
    decode steps compile in the process (a CPU's, unless eager)."""
    stack = sum(
        parameter_bytes(block) for _, blocks in find_layer_stacks(model) for block in blocks
    )
    return FixedOverhead(
        process_bytes=PROCESS_BASELINE_BYTES,
        outside_stack_bytes=parameter_bytes(model) - stack,
        tokenizer_bytes=tokenizer_bytes(tokenizer_folder) if tokenizer_folder else 0,
        compiler_bytes=COMPILER_BYTES if compiles else 0,
    )


def tokenizer_bytes(folder: Path) -> int:
    """What the tokenizer whose files are in `folder` takes once loaded (an estimate from
    the size of its vocabulary files)."""
    folder = Path(folder)
    if not folder.is_dir():
        return 0
    found = sum(
        (folder / name).stat().st_size for name in _TOKENIZER_FILES if (folder / name).is_file()
    )
    return found * TOKENIZER_BYTES_PER_FILE_BYTE
