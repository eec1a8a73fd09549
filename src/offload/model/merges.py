"""Checkpoint keys under the model's names, as transformers' `from_pretrained` renames
them, and parameters that transformers assembles from several checkpoint tensors.

transformers 5 stores a mixture of experts as one stacked tensor per layer (Mixtral's
`experts.gate_up_proj` is [experts, 2 x intermediate, hidden]) while the checkpoints on
the hub keep one tensor per expert and projection. Its conversion mapping says how to
stack (`MergeModulelist`) and join (`Concatenate`) them. Here that becomes a list of
parts, each a checkpoint tensor and the slice of the parameter it fills, so the loader
reads every part from the file straight into its place: no merged copy is ever made.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn

from offload.errors import ModelError
from offload.memory.safetensors import StoredTensor


@dataclass(frozen=True)
class Converted:
    """How one checkpoint key feeds a parameter transformers assembles."""

    operations: tuple[tuple[str, int], ...]  # (operation name, dim), in order
    pattern: int  # which of the converter's source patterns the key matched
    expert: int | None  # the number the pattern's `*` matched, if it has one


@dataclass
class Assembled:
    """A parameter made of several checkpoint tensors: each part and where it goes."""

    name: str  # the parameter's name
    shape: tuple[int, ...]
    parts: list[tuple[StoredTensor, tuple[int | slice, ...]]] = field(default_factory=list)

    @property
    def num_bytes(self) -> int:
        return sum(stored.num_bytes for stored, _ in self.parts)

    @property
    def largest_part_bytes(self) -> int:
        return max(stored.num_bytes for stored, _ in self.parts)


_SUPPORTED = {"MergeModulelist", "Concatenate"}


def transformers_renaming(
    model: nn.Module, stored: Mapping[str, StoredTensor]
) -> dict[str, tuple[str, Converted | None]]:
    """Each checkpoint key -> (its name after the key renamings transformers registers for
    the model's architecture, and how it is merged when transformers merges it). Keys go
    in transformers' order, which some renamings depend on. No renaming where this
    transformers has no conversion mapping."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            apply_renamings,
            dot_natural_key,
        )

        transforms = get_model_conversion_mapping(model)
    except (ImportError, AttributeError, TypeError):
        return {key: (key, None) for key in stored}
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamed = {}
    for key in sorted(stored, key=dot_natural_key):
        name = apply_renamings(key, renamings)
        converted = None
        for converter in converters:  # at most one converter takes a key, as in transformers
            target, pattern = converter.rename_source_key(name)
            if pattern is not None:
                converted = _converted(key, name, converter, pattern)
                name = target
                break
        renamed[key] = (name, converted)
    return renamed


def _converted(key: str, name: str, converter, pattern: str) -> Converted:
    operations = tuple((type(op).__name__, getattr(op, "dim", None)) for op in converter.operations)
    expert = None
    if "*" in pattern:
        literal = r"(\d+)".join(re.escape(piece) for piece in pattern.split("*"))
        found = re.search(literal, name)
        expert = int(found.group(1)) if found else None
    if any(op not in _SUPPORTED for op, _ in operations) or ("*" in pattern and expert is None):
        raise ModelError(
            f"the checkpoint stores {key!r} as a part that transformers converts with "
            f"{[op for op, _ in operations]}; offload assembles parameters only by stacking "
            "experts (MergeModulelist) and joining tensors (Concatenate)"
        )
    return Converted(operations, converter.source_patterns.index(pattern), expert)


def assemble(
    name: str, shape: tuple[int, ...], parts: list[tuple[StoredTensor, Converted]]
) -> Assembled:
    """Where each part goes in the parameter `name` of `shape`, checked: every expert
    from 0 up, one shape per source pattern, and together exactly the parameter."""
    operations = parts[0][1].operations
    merge = next((dim for op, dim in operations if op == "MergeModulelist"), None)
    join = next((dim for op, dim in operations if op == "Concatenate"), None)
    by_pattern: dict[int, dict[int | None, StoredTensor]] = {}
    for stored, converted in parts:
        by_pattern.setdefault(converted.pattern, {})[converted.expert] = stored
    if join is None and len(by_pattern) > 1:
        raise ModelError(f"{name}: several kinds of parts and no way to join them")
    assembled = Assembled(name, shape)
    offset = 0
    for pattern in sorted(by_pattern):
        experts = by_pattern[pattern]
        first = next(iter(experts.values()))
        if merge is not None and sorted(experts) != list(range(len(experts))):
            raise ModelError(
                f"{name}: the checkpoint's experts are {sorted(experts)}, not 0 to n-1"
            )
        if any(s.shape != first.shape for s in experts.values()):
            raise ModelError(f"{name}: the checkpoint's parts of one kind differ in shape")
        block = list(first.shape)
        if merge is not None:
            block.insert(merge, len(experts))  # [experts, ...] once stacked
        size = block[join] if join is not None else 0
        for expert, stored in experts.items():
            index: list[int | slice] = [slice(None)] * len(block)
            if join is not None:
                index[join] = slice(offset, offset + size)
            if merge is not None:
                index[merge] = expert
            assembled.parts.append((stored, tuple(index)))
        offset += size
        if join is not None:
            block[join] = offset
        assembled_shape = tuple(block)
    if assembled_shape != tuple(shape):
        raise ModelError(
            f"{name}: the checkpoint's parts make shape {assembled_shape}, model expects "
            f"{tuple(shape)}"
        )
    return assembled
