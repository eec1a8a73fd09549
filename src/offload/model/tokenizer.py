"""The tokenizer of a model folder and the ids that end a sequence."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from offload.errors import ModelError


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    """The model folder's tokenizer, or one clear error (before any weight is read). The
    folder's own tokenizer code (`auto_map`) runs only with `trust_remote_code=True`."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError, KeyError) as error:
        if not trust_remote_code and _names_own_tokenizer(path):
            raise ModelError(
                f"{path}: the tokenizer needs the checkpoint's own Python code (auto_map's "
                "AutoTokenizer), which offload does not run; "
                "trust_remote_code=True (--trust-remote-code) would run it"
            ) from None
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelError(
            f"{path} has no usable tokenizer (tokenizer.json or tokenizer_config.json with "
            f"its vocabulary files): {reason}"
        ) from None


def save_tokenizer(tokenizer, folder: Path) -> None:
    """`tokenizer` saved into `folder` (a conversion's), its added tokens listed in
    tokenizer_config.json as the hub's folders list them: without that list transformers
    parses all of tokenizer.json in Python to find them at every load, besides the Rust
    parse (the default model's tokenizer loads in 0.10 s instead of 0.23)."""
    tokenizer.save_pretrained(folder)
    settings_file = Path(folder) / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text())
    if "added_tokens_decoder" not in settings:
        added = tokenizer.added_tokens_decoder.items()
        settings["added_tokens_decoder"] = {str(i): t.__getstate__() for i, t in added}
        settings_file.write_text(json.dumps(settings, indent=2, ensure_ascii=False))


def _names_own_tokenizer(path: Path) -> bool:
    """Whether the folder names a tokenizer class of its own code, where transformers looks
    for one: `auto_map.AutoTokenizer` of tokenizer_config.json, then of config.json."""
    for name in ("tokenizer_config.json", "config.json"):
        # An unreadable file names nothing; the caller reports the load's own error.
        with contextlib.suppress(OSError, ValueError, RecursionError, AttributeError):
            auto_map = json.loads((Path(path) / name).read_text()).get("auto_map")
            if isinstance(auto_map, dict) and "AutoTokenizer" in auto_map:
                return True
    return False


def eos_token_ids(path: Path, tokenizer, config) -> frozenset[int]:
    """Every id that ends a sequence: the tokenizer's end token and, as vLLM and
    transformers do, the `eos_token_id`s of `generation_config.json` (Llama 3 and Qwen
    instruct models list several there) and of the model config."""
    ids = set(_as_ids(tokenizer.eos_token_id))
    ids |= _as_ids(getattr(config, "eos_token_id", None))
    generation = Path(path) / "generation_config.json"
    if generation.is_file():
        # An unreadable generation config only loses its extra end ids.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            ids |= _as_ids(json.loads(generation.read_text()).get("eos_token_id"))
    vocab = getattr(config, "vocab_size", None)
    return frozenset(i for i in ids if vocab is None or 0 <= i < vocab)


def _as_ids(value) -> set[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list | tuple):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


class NoTokenizer:
    """The stand-in for a model loaded without one (`load_format="dummy"` from a bare
    config.json, as vLLM's `skip_tokenizer_init`): prompts must be token ids, and outputs
    carry token ids with empty text."""

    pad_token_id = 0
    eos_token_id = None
    chat_template = None
    _MESSAGE = (
        "this model has no tokenizer (load_format='dummy' from a config.json alone): "
        "pass prompts as {'prompt_token_ids': [...]}"
    )

    def __call__(self, *args, **kwargs):
        raise ModelError(self._MESSAGE)

    def apply_chat_template(self, *args, **kwargs):
        raise ModelError(self._MESSAGE)

    def decode(self, *args, **kwargs) -> str:
        return ""

    def convert_ids_to_tokens(self, ids):
        return [""] * len(ids) if isinstance(ids, list) else ""

    def __len__(self) -> int:
        return 0
