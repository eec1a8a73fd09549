"""Speculative decoding's draft model (`speculative_config` with a `model`): loaded with
the `LLM` it drafts for, on its device, resident, and checked to share its tokenizer."""

from __future__ import annotations

from typing import Any

from offload.engine.draft import DraftProposer
from offload.engine.requests import EngineModel
from offload.engine.speculative import NgramProposer, SpeculativeConfig
from offload.errors import ConfigError


def load_drafter(llm: Any, config: SpeculativeConfig | None) -> Any:
    """The draft `LLM` of `llm` where `config` names a draft model (else None); a
    tokenizer other than `llm`'s is refused in one line, naming both."""
    if config is None or config.method != "draft_model":
        return None
    draft = type(llm)(  # (an `LLM`, as `llm` is: llm.py imports this module)
        config.model,
        quantization=config.quantization,
        device=llm.device,
        progress=False,
        enable_prefix_caching=False,
    )
    mine, theirs = llm.tokenizer, draft.tokenizer
    if mine.get_vocab() != theirs.get_vocab():
        draft.close()
        raise ConfigError(
            f"speculative_config: the draft model {config.model!r} has another tokenizer "
            f"({len(theirs)} tokens) than the model ({len(mine)}); a draft must share it"
        )
    return draft


def speculator_of(llm: Any, rows: int, length: int):
    """What guesses the next tokens of a core of `rows` rows of `length` positions over
    `llm` (`speculative_config`), or None."""
    config = llm.speculative_config
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config)
    draft = llm._drafter
    model = EngineModel(
        draft.model, draft._tokens, draft.device, draft.tokenizer.pad_token_id or 0, draft._lock
    )
    return DraftProposer(config, model, rows, length)
