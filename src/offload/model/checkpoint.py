"""What a checkpoint holds for each of the model's tensors: its safetensors files, and
their keys matched to the model's names as transformers' `from_pretrained` matches them.
Everything is checked before anything is allocated."""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch import nn

from offload.errors import ModelError
from offload.memory.safetensors import StoredTensor
from offload.model.merges import Assembled, Converted, assemble, transformers_renaming


def checkpoint_targets(
    model: nn.Module, stored: dict[str, StoredTensor], dummy: bool
) -> dict[str, StoredTensor | None]:
    """Checkpoint entry of each parameter and persistent buffer (tied names share one
    tensor: the first name the checkpoint has wins). Checked before anything is allocated."""
    names = dict(model.named_parameters(remove_duplicate=False))
    names.update(
        (n, b) for n, b in model.named_buffers(remove_duplicate=False) if n in model.state_dict()
    )
    if dummy:
        return dict.fromkeys(dict(model.named_parameters()))
    shapes = {name: tuple(tensor.shape) for name, tensor in names.items()}
    stored, unexpected = _by_model_name(model, stored, shapes)
    # (a pipeline stage: what the other ranks hold is theirs to load, `distributed.cut`)
    elsewhere = tuple(getattr(model, "elsewhere", ()))
    unexpected = [k for k in unexpected if not _elsewhere(k, elsewhere)]
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in names.items():
        by_tensor.setdefault(id(tensor), []).append(name)
    targets: dict[str, StoredTensor | None] = {}
    missing = []
    for aliases in by_tensor.values():
        found = [stored[a] for a in aliases if a in stored]
        if found:
            targets[aliases[0]] = found[0]
        elif not names[aliases[0]].is_meta:  # a buffer computed at construction
            continue
        else:
            missing.append(aliases[0])
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {sorted(unexpected)[:3]}"
        raise ModelError(f"the checkpoint does not match the model's parameters: {what}")
    for name, entry in targets.items():
        if tuple(names[name].shape) != entry.shape:
            raise ModelError(
                f"{name}: checkpoint shape {entry.shape}, model expects {tuple(names[name].shape)}"
            )
    return targets


def _elsewhere(key: str, prefixes: tuple[str, ...]) -> bool:
    """Whether checkpoint key `key` (under the model's name or the base model's) is under
    one of `prefixes`."""
    return bool(prefixes) and any(
        name.startswith(prefixes) for name in (key, f"model.{key}", key.removeprefix("model."))
    )


def _by_model_name(
    model: nn.Module, stored: dict[str, StoredTensor], shapes: Mapping[str, tuple[int, ...]]
) -> tuple[dict[str, StoredTensor | Assembled], list[str]]:
    """The checkpoint's tensors under the model's names, and the checkpoint keys that are
    none of them. Keys are renamed as transformers' `from_pretrained` does: first the
    architecture's own renamings (GPT-NeoX's `embed_out` is `lm_head`), then the base
    model's prefix is added for a checkpoint of the base model alone (Llama's `norm.weight`
    is `model.norm.weight`). A key the model has as it is keeps its name. Parts that
    transformers merges (a mixture's experts) become one `Assembled` parameter."""
    names = shapes.keys()
    prefix = getattr(model, "base_model_prefix", "")
    # Keys transformers drops without complaint: the model's own list (GPT-2's attention
    # masks) and the rotary inverse frequencies that older checkpoints saved as weights.
    ignored = [*(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())]
    ignored.append(r"rotary_emb\.inv_freq$")
    by_name: dict[str, StoredTensor | Assembled] = {}
    merged: dict[str, list[tuple[StoredTensor, Converted]]] = {}
    unexpected = []
    for key, (name, converted) in transformers_renaming(model, stored).items():
        if name not in names and key in names:
            name, converted = key, None
        if name not in names and prefix and f"{prefix}.{name}" in names:
            name = f"{prefix}.{name}"
        if name not in names:
            if not any(re.search(pattern, key) for pattern in ignored):
                unexpected.append(key)
            continue
        if converted is not None:
            merged.setdefault(name, []).append((stored[key], converted))
            continue
        if name in by_name:
            raise ModelError(
                f"the checkpoint has both {by_name[name].name!r} and {key!r} for the "
                f"model's {name!r}; a checkpoint has one tensor per parameter"
            )
        by_name[name] = stored[key]
    for name, parts in merged.items():
        if name in by_name:
            raise ModelError(
                f"the checkpoint has {by_name[name].name!r} and parts of it for the model's {name!r}"
            )
        by_name[name] = assemble(name, shapes[name], parts)
    return by_name, unexpected
