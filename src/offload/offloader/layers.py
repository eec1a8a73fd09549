"""Find the repeated block stacks of any `nn.Module` (decoder layers, encoder layers, ...)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from offload.errors import ModelError


def _block_runs(module: nn.Module) -> list[tuple[str, list[nn.Module]]]:
    """The block stacks directly inside `module`, as (suffix, blocks): a ModuleList (of
    any blocks) or a Sequential of one block type, with at least two children that all
    hold parameters; or, in a Sequential that mixes types (`stem, block, ..., head`),
    each run of two or more consecutive children of one type with the same parameter
    shapes."""
    children = list(module.children())
    whole = isinstance(module, nn.ModuleList) or (
        isinstance(module, nn.Sequential) and len({type(c) for c in children}) == 1
    )
    # (a pipeline stage's layers are a stack even where it holds one: `is_layer_stack`)
    least = 1 if getattr(module, "is_layer_stack", False) else 2
    if whole and len(children) >= least and all(_has_params(child) for child in children):
        return [("", children)]
    if not isinstance(module, nn.Sequential):
        return []
    runs, start = [], 0
    for end in range(1, len(children) + 1):
        if end == len(children) or _signature(children[end]) != _signature(children[start]):
            if end - start >= 2 and _has_params(children[start]):
                runs.append((f"[{start}:{end}]", children[start:end]))
            start = end
    return runs


def _signature(module: nn.Module) -> tuple:
    return type(module), tuple((n, p.shape) for n, p in module.named_parameters())


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def find_layer_stacks(model: nn.Module) -> list[tuple[str, list[nn.Module]]]:
    """The outermost block stacks of `model` as (qualified name, blocks), in
    registration order: `model.layers` for a Llama, `encoder.block` and
    `decoder.block` for a T5, `[1:9]` for the blocks of a `Sequential(stem, blocks...,
    head)`. Stacks nested inside another stack's blocks (the experts of an MoE layer,
    say) belong to their block and are not listed."""
    stacks = [
        (name + suffix, blocks)
        for name, module in model.named_modules()
        for suffix, blocks in _block_runs(module)
    ]
    nested: set[int] = set()
    for _, blocks in stacks:
        for block in blocks:
            nested.update(id(m) for m in block.modules() if m is not block)
    return [(name, blocks) for name, blocks in stacks if id(blocks[0]) not in nested]


def find_layers(model: nn.Module) -> list[nn.Module]:
    """The blocks of every outermost stack, in order; a clear error if there are none."""
    stacks = find_layer_stacks(model)
    if not stacks:
        raise ModelError(
            f"found no repeated layer stack in {type(model).__name__} (no nn.ModuleList or "
            "nn.Sequential of two or more blocks with parameters); pass layers= explicitly"
        )
    return [block for _, blocks in stacks for block in blocks]


def resolve_layers(
    model: nn.Module, layers: str | nn.Module | Iterable[nn.Module]
) -> list[nn.Module]:
    """The layers a user named: a qualified module name, a ModuleList or Sequential of
    blocks, one module, or an iterable of modules."""
    if isinstance(layers, str):
        try:
            layers = model.get_submodule(layers)
        except AttributeError:
            raise ModelError(
                f"layers={layers!r} names no submodule of {type(model).__name__}"
            ) from None
    if isinstance(layers, nn.ModuleList | nn.Sequential):
        blocks = list(layers.children())
    elif isinstance(layers, nn.Module):
        blocks = [layers]
    else:
        blocks = list(layers)
    owned = {id(m) for m in model.modules()}
    for block in blocks:
        if not isinstance(block, nn.Module) or id(block) not in owned:
            raise ModelError(
                f"layers must be submodules of the model; got {type(block).__name__} that is not"
            )
    if not blocks:
        raise ModelError("layers= is empty; pass the model's layer modules or leave it out")
    return blocks
