"""A decode step over a static KV cache (`DecodeStep`: what the probes time and the
compiled CPU step's tests run), and the one-token forward every decode step runs
(`last_logits`). The engine core's steps and their CUDA graphs: `rows.py`,
`row_graphs.py`."""

from __future__ import annotations

import torch

from offload.engine.transformers_cache import cache_argument


class DecodeStep:
    """A model's decode forward over static buffers: the token, position and cache
    position of each step are copied in, and the attention mask is updated in place, so
    the same addresses serve every step (what a CUDA graph replays)."""

    def __init__(self, model: torch.nn.Module, cache, mask: torch.Tensor, positions: torch.Tensor):
        batch = mask.shape[0]
        self._model = model
        self._cache = cache_argument(model, cache)  # (once: dynamo cannot trace its lookup)
        self.mask = mask  # [batch, length]
        self.input_ids = torch.zeros(batch, 1, dtype=torch.long, device=mask.device)
        # [batch, 1], laid out alike whatever the prompt's width (a clone of the column keeps
        # the width as its row stride, and a compiled step guards strides: a new prompt
        # length would compile again).
        self.position_ids = torch.empty_like(
            positions[:, -1:], memory_format=torch.contiguous_format
        )
        self.position_ids.copy_(positions[:, -1:])
        self.cache_position = torch.zeros(1, dtype=torch.long, device=mask.device)

    def prepare(self, tokens: torch.Tensor, position: int) -> None:
        """Inputs of the step that writes cache position `position`."""
        self.input_ids.copy_(tokens[:, None])
        self.position_ids.add_(1)
        self.cache_position.fill_(position)
        self.mask[:, position] = 1

    def __call__(self) -> torch.Tensor:
        return last_logits(self)


def last_logits(step, mask=None) -> torch.Tensor:
    """The one-token forward of `step` (a `DecodeStep` or a `rows.RowStep`: its model,
    cache argument and inputs; `mask`: the masks in place of its 2D one); the logits of
    each row's new token, [rows, vocab]."""
    out = step._model(
        input_ids=step.input_ids,
        attention_mask=step.mask if mask is None else mask,
        position_ids=step.position_ids,
        **step._cache,
        cache_position=step.cache_position,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1, :]
