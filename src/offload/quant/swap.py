"""GGUF's quantized weights swapped into a model built on the meta device: each module
whose weight config.json names becomes its layout's (`traits.LAYOUTS`), tied weights
kept tied."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from offload.errors import ModelError
from offload.quant.kinds import QuantLayout
from offload.quant.quantized import ROW_ORDERS_KEY, GGUFLinear
from offload.quant.traits import LAYOUTS, LayoutTraits

# A tied head's module: the linear layer of its embedding's layout.
_HEADS = {t.embedding: t.linear for t in LAYOUTS.values() if t.embedding is not None}


def swap_in_quantized(
    model: nn.Module,
    types: Mapping[str, str],
    where: object,
    layouts: Mapping[str, str] | None = None,
    orders: Mapping[str, int] | None = None,
) -> None:
    """Replace each module whose weight `types` names by its quantized form in its layout
    (`layouts`, default GGUF's blocks; `orders`: weights in llama.cpp's row order, and
    their heads), keeping tied weights tied (Llama's lm_head reads the embedding's)."""
    owners = {name.removesuffix(".weight"): kind for name, kind in types.items()}
    placed = {name.removesuffix(".weight"): kind for name, kind in (layouts or {}).items()}
    heads = {name.removesuffix(".weight"): count for name, count in (orders or {}).items()}
    if set(heads) - {n for n in owners if placed.get(n, QuantLayout.GGUF) == QuantLayout.GGUF}:
        raise ModelError(f"{where}: {ROW_ORDERS_KEY} names weights not kept in GGUF's blocks")
    tied = _tied_to_embedding(model)
    swapped: dict[str, nn.Module] = {}
    for name, module in list(model.named_modules()):
        if name not in owners:
            continue
        traits = LAYOUTS.get(placed.get(name, QuantLayout.GGUF))
        made = None if traits is None else _module_of(traits, module)
        if name in heads and made is GGUFLinear:
            new: nn.Module = GGUFLinear(module, owners[name], heads[name])  # type: ignore[arg-type]
        elif isinstance(module, nn.Linear | nn.Embedding) and made is not None:
            new = made(module, owners[name])  # type: ignore[call-arg]
        elif isinstance(module, nn.Linear | nn.Embedding):
            raise ModelError(f"{where}: {name} cannot be kept as {placed[name]}")
        else:
            raise ModelError(
                f"{where}: {name} is a {type(module).__name__}; quantized: Linear, Embedding"
            )
        model.set_submodule(name, new)
        swapped[name] = new
    missing = set(owners) - set(swapped)
    if missing:
        raise ModelError(
            f"{where}: weight_types names {sorted(missing)[:3]}, which the model has not"
        )
    if tied is not None:
        embedding_name, head_name = tied
        embedding, head = model.get_submodule(embedding_name), model.get_submodule(head_name)
        head_type = _HEADS.get(type(embedding))
        if head_type is not None:
            if not isinstance(head, head_type):  # (the file has no head of its own)
                head = head_type(head, embedding.kind)
                model.set_submodule(head_name, head)
            for name, parameter in embedding.named_parameters(recurse=False):
                setattr(head, name, parameter)


def _tied_to_embedding(model: nn.Module) -> tuple[str, str] | None:
    """(embedding's name, output head's name) when the head's weight is the embedding's."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embedding is None or head is None or head.weight is not embedding.weight:
        return None
    names = {id(module): name for name, module in model.named_modules()}
    return names[id(embedding)], names[id(head)]


def _module_of(traits: LayoutTraits, module: nn.Module) -> type[nn.Module] | None:
    """The module `module` becomes in the layout of `traits` (an embedding's, else a linear
    layer's: a module of another type is refused by the caller)."""
    return traits.linear if isinstance(module, nn.Linear) else traits.embedding
