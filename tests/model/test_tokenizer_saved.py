"""A conversion's tokenizer (`model.tokenizer.save_tokenizer`): it lists its added tokens
in tokenizer_config.json, so a load never parses tokenizer.json in Python (only in Rust),
and it loads to the tokenizer transformers saved, token for token."""

from __future__ import annotations

import builtins
from pathlib import Path

from transformers import AutoTokenizer

from offload.model.tokenizer import load_tokenizer, save_tokenizer

CHAT = [{"role": "user", "content": "What is the capital of France? <|im_end|> café"}]


def _pythons_reads(folder: Path, monkeypatch) -> list[str]:
    """The names of the folder's files that Python opened while loading its tokenizer."""
    opened, real_open = [], builtins.open

    def recording(file, *args, **kwargs):
        if str(file).startswith(str(folder)):
            opened.append(Path(file).name)
        return real_open(file, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(builtins, "open", recording)
        load_tokenizer(folder)
    return opened


def test_a_saved_tokenizer_loads_alike_without_parsing_its_json_in_python(
    smollm2_path, tmp_path, monkeypatch
):
    source = AutoTokenizer.from_pretrained(smollm2_path)
    plain, ours = tmp_path / "plain", tmp_path / "ours"
    source.save_pretrained(plain)
    save_tokenizer(source, ours)
    assert "tokenizer.json" in _pythons_reads(plain, monkeypatch)  # (what it spares)
    assert "tokenizer.json" not in _pythons_reads(ours, monkeypatch)
    before, after = load_tokenizer(plain), load_tokenizer(ours)
    assert after.added_tokens_decoder == before.added_tokens_decoder
    assert after.all_special_tokens == before.all_special_tokens
    assert after.all_special_ids == before.all_special_ids
    assert after.apply_chat_template(CHAT, tokenize=False) == before.apply_chat_template(
        CHAT, tokenize=False
    )
    ids = before.apply_chat_template(CHAT, add_generation_prompt=True)
    assert after.apply_chat_template(CHAT, add_generation_prompt=True) == ids
    assert after.decode(ids) == before.decode(ids)
    assert (
        after("<|im_start|>hi <|endoftext|>")["input_ids"]
        == before("<|im_start|>hi <|endoftext|>")["input_ids"]
    )
