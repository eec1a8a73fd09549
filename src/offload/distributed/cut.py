"""A model cut to one pipeline stage, before anything is loaded: the decoder layers of the
other ranks are gone (their weights are never read), the embedding stays on the first
rank (and on the last where the head reads its table), the head on the last. The model's
own forward still runs whole on every rank: the stand-ins give tensors of the right
shape, and the hidden states come in before the stage's first layer and go out after its
last (`Link`), so every layer computes what it would in one process."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
from torch import nn

from offload.errors import ConfigError
from offload.offloader.layers import find_layer_stacks
from offload.planner.stages import Stage
from offload.sizes import compute_dtype


class StageLayers(nn.ModuleList):
    """The decoder layers one rank holds, under their own indices (their parameters keep
    the checkpoint's names, `model.layers.12.mlp...`), run in order by the model's loop
    (`self.layers[: num_hidden_layers]` is every one of them)."""

    is_layer_stack = True  # (`offloader.layers`: a stack even of one layer)

    def __init__(self, layers: dict[int, nn.Module]):
        super().__init__()
        for index, layer in layers.items():
            self.add_module(str(index), layer)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return list(self._modules.values())[index]
        return self._modules[str(index)]


class NoEmbedding(nn.Module):
    """The embedding on a rank that does not hold it: zeros of the hidden states' shape
    (the stage's first layer takes the previous rank's hidden states instead)."""

    def __init__(self, num_embeddings: int, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.hidden_size, self.dtype = num_embeddings, hidden_size, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        zero = torch.zeros((), dtype=self.dtype, device=input_ids.device)
        return zero.expand(*input_ids.shape, self.hidden_size)


class NoHead(nn.Module):
    """The head on a rank that does not hold it: zero logits of the right shape (the last
    rank's are the ones the engine samples from)."""

    def __init__(self, vocab_size: int, dtype: torch.dtype):
        super().__init__()
        self.vocab_size, self.dtype = vocab_size, dtype

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        zero = torch.zeros((), dtype=self.dtype, device=hidden.device)
        return zero.expand(*hidden.shape[:-1], self.vocab_size)


def layer_stack(model: nn.Module) -> tuple[nn.Module, str, list[nn.Module]]:
    """The module holding `model`'s one stack of decoder layers, its attribute name, and
    the layers; a clear error where there is not exactly one stack."""
    stacks = find_layer_stacks(model)
    if len(stacks) != 1 or "[" in stacks[0][0]:
        raise ConfigError(
            "pipeline_parallel_size > 1 needs a model with one list of decoder layers; "
            f"{type(model).__name__} has {len(stacks)} layer stacks"
        )
    name, layers = stacks[0]
    parent, _, attribute = name.rpartition(".")
    return model.get_submodule(parent), attribute, layers


def stage_bytes(model: nn.Module) -> tuple[list[int], int, int]:
    """The weight bytes each step reads of each decoder layer, of the first stage's own
    (none: the embedding gives a few rows a step) and of the last's (the head, or the
    embedding's table it reads where they are tied): what `split_layers` weighs."""
    _, _, layers = layer_stack(model)
    per_layer = [_bytes(layer) for layer in layers]
    head = model.get_output_embeddings()
    return per_layer, 0, 0 if head is None else _bytes(head)


def cut_to_stage(model: nn.Module, stage: Stage) -> nn.Module:
    """`model` (built on the meta device, nothing loaded) holding only what `stage`'s rank
    runs. Its `held_layers` names the decoder layers it holds (a KV cache allocates for
    those alone) and `elsewhere` the checkpoint prefixes other ranks load."""
    parent, attribute, layers = layer_stack(model)
    prefix = _prefix_of(model, parent)
    held = {index: layers[index] for index in stage.layers}
    setattr(parent, attribute, StageLayers(held))
    elsewhere = [f"{prefix}{attribute}.{i}." for i in range(len(layers)) if i not in held]
    dtype, config = compute_dtype(model), model.config
    embedding, head, tied = (
        model.get_input_embeddings(),
        model.get_output_embeddings(),
        _tied(model),
    )
    if not stage.is_first and not (stage.is_last and tied):
        elsewhere.append(_name_of(model, embedding))
        model.set_input_embeddings(NoEmbedding(embedding.num_embeddings, config.hidden_size, dtype))
    if not stage.is_last and head is not None:
        if not tied:
            elsewhere.append(_name_of(model, head))
        model.set_output_embeddings(NoHead(head.weight.shape[0], dtype))
    model.held_layers = tuple(stage.layers)
    model.elsewhere = tuple(elsewhere)
    return model


class Link:
    """The hidden states' way into this rank's stage (received before its first layer,
    from the rank before) and out of it (sent after its last layer, to the rank after),
    live only inside `live()`: other forwards (a probe of the KV dims) stay local."""

    def __init__(self, channel, stage: Stage):
        self.channel, self.stage = channel, stage
        self._live = False
        self._handles: list = []
        self.waited_s = 0.0  # in receives of the hidden states (the rank before's work)

    def attach(self, model: nn.Module) -> None:
        layers = _stage_layers(model)
        if not self.stage.is_first:
            hook = layers[0].register_forward_pre_hook(self._receive, with_kwargs=True)
            self._handles.append(hook)
        if not self.stage.is_last:
            self._handles.append(layers[-1].register_forward_hook(self._send))

    @contextlib.contextmanager
    def live(self) -> Iterator[None]:
        self._live = True
        try:
            yield
        finally:
            self._live = False

    def _receive(self, module, args, kwargs):
        if not self._live:
            return None
        start = time.perf_counter()
        hidden = self.channel.recv_tensor(self.stage.rank - 1, self.channel.HIDDEN)
        self.waited_s += time.perf_counter() - start
        if args:
            return (hidden.to(args[0].device), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden.to(kwargs["hidden_states"].device)}

    def _send(self, module, args, output):
        if self._live:
            hidden = output[0] if isinstance(output, tuple) else output
            self.channel.send_tensor(hidden, self.stage.rank + 1, self.channel.HIDDEN)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _stage_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of a model cut by `cut_to_stage`, in order."""
    for module in model.modules():
        if isinstance(module, StageLayers):
            return list(module)
    raise ConfigError("the model was not cut to a pipeline stage")


def _tied(model: nn.Module) -> bool:
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and getattr(head, "weight", None) is getattr(embedding, "weight", 0)


def _bytes(module: nn.Module) -> int:
    seen = {id(p): p.numel() * p.element_size() for p in module.parameters()}
    return sum(seen.values())


def _name_of(model: nn.Module, module: nn.Module) -> str:
    for name, candidate in model.named_modules():
        if candidate is module:
            return f"{name}."
    raise ConfigError(f"{type(module).__name__} is not part of the model")


def _prefix_of(model: nn.Module, parent: nn.Module) -> str:
    name = _name_of(model, parent)
    return "" if name == "." else name
