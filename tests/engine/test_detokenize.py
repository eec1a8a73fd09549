"""A sequence's text, decoded a window at a time (`engine/detokenize`), equals the whole
decode of its tokens after every token: for the default model's byte-level tokenizer
(characters split across tokens), a sentencepiece-style one (a leading space stripped from
the first token only) and, decoded whole, one whose clean-up joins text across tokens."""

import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from offload.engine.detokenize import SAMPLE, Detokenizer
from offload.engine.tokens import TokenSteps

TEXTS = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40
) | st.sampled_from([SAMPLE, "a 🚀b", "東京 ok", "  x.\n\ny", "naïve, café!"])


@pytest.fixture(scope="module")
def byte_level(smollm2_path):
    return transformers.AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def metaspace():
    """A small BPE over "▁"-marked words, as sentencepiece writes them, with byte fallback."""
    model = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    model.pre_tokenizer = pre_tokenizers.Metaspace()
    model.decoder = decoders.Sequence(
        [decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()]
    )
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *bytes_])
    model.train_from_iterator([SAMPLE, "hello world, the old harbour town"] * 20, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=model, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )  # fmt: skip


def _every_step_equal(tokenizer, tokens, skip):
    detokenizer = Detokenizer(tokenizer)
    window = None
    for end in range(1, len(tokens) + 1):
        text, window = detokenizer.text(tokens[:end], window, skip)
        assert text == tokenizer.decode(tokens[:end], skip_special_tokens=skip), tokens[:end]
    return detokenizer


@pytest.mark.parametrize("name", ["byte_level", "metaspace"])
@settings(max_examples=60, deadline=None)
@given(texts=st.lists(TEXTS, min_size=1, max_size=3), noise=st.lists(st.integers(0, 10**6)),
       skip=st.booleans())  # fmt: skip
def test_each_steps_text_is_the_whole_decode(request, name, texts, noise, skip):
    tokenizer = request.getfixturevalue(name)
    tokens = [t for text in texts for t in tokenizer(text, add_special_tokens=False).input_ids]
    # (ids anywhere in the vocabulary too, special ones and single bytes among them)
    tokens += [n % len(tokenizer) for n in noise[:20]]
    assert _every_step_equal(tokenizer, tokens, skip).incremental


def test_a_tokenizer_that_cleans_up_across_tokens_decodes_whole(metaspace, byte_level):
    byte_level.clean_up_tokenization_spaces = True
    try:
        tokens = byte_level("Hi , you . Done !", add_special_tokens=False).input_ids
        assert not _every_step_equal(byte_level, tokens, True).incremental
    finally:
        byte_level.clean_up_tokenization_spaces = False


def test_the_engines_texts_come_a_window_at_a_time(byte_level):
    steps = TokenSteps(byte_level, [byte_level.eos_token_id])
    assert steps.detokenizer.incremental  # (the default model's tokenizer takes windows)
    calls = []
    decode = byte_level.decode
    byte_level.decode = lambda tokens, **kw: calls.append(len(tokens)) or decode(tokens, **kw)
    try:
        tokens = byte_level(SAMPLE * 8, add_special_tokens=False).input_ids
        window = None
        for end in range(1, len(tokens) + 1):
            _, window = steps.detokenizer.text(tokens[:end], window)
    finally:
        del byte_level.decode
    assert max(calls) < 20 < len(tokens)  # (no decode of the whole list)
