"""Find the repeated block stacks of any `nn.Module` (decoder layers, encoder layers, ...)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from offload.errors import ModelError


def _is_block_stack(module: nn.Module) -> bool:
    """A ModuleList (of any blocks) or a Sequential of one block type, with at least two
    children that all hold parameters."""
    children = list(module.children())
    if len(children) < 2 or not all(_has_params(child) for child in children):
        return False
    if isinstance(module, nn.ModuleList):
        return True
    return isinstance(module, nn.Sequential) and len({type(c) for c in children}) == 1


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def find_layer_stacks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost block stacks of `model` as (qualified name, container), in
    registration order: `model.layers` for a Llama, `encoder.block` and
    `decoder.block` for a T5. Stacks nested inside another stack's blocks (the
    experts of an MoE layer, say) belong to their block and are not listed."""
    stacks = [(name, m) for name, m in model.named_modules() if _is_block_stack(m)]
    nested: set[int] = set()
    for _, stack in stacks:
        for block in stack.children():
            nested.update(id(m) for m in block.modules())
    return [(name, stack) for name, stack in stacks if id(stack) not in nested]


def find_layers(model: nn.Module) -> list[nn.Module]:
    """The blocks of every outermost stack, in order; a clear error if there are none."""
    stacks = find_layer_stacks(model)
    if not stacks:
        raise ModelError(
            f"found no repeated layer stack in {type(model).__name__} (no nn.ModuleList or "
            "nn.Sequential of two or more blocks with parameters); pass layers= explicitly"
        )
    return [block for _, stack in stacks for block in stack.children()]


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
