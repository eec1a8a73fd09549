"""Hostile .gguf headers (issue 48's red team): each refused by name, from our own header
parser, before gguf's or transformers' reader sees the file."""

from __future__ import annotations

import struct
import time

import gguf
import numpy as np
import pytest

from offload.errors import ModelError
from offload.model import sources
from offload.model.gguf_checks import check_gguf_header


def _tiny(path, layers=2, hidden=8, heads=2, kv_heads=1, tokens=4, eos=1, numbers=None, more=None):
    """A header-and-float32 Llama small enough to write in milliseconds: `layers` blocks of
    two norms and a query, a token list of `tokens` words, `numbers` set over the rest,
    and whatever `more(writer)` adds."""
    writer = gguf.GGUFWriter(path, "llama")
    if more is not None:
        more(writer)
    settings = {
        "llama.context_length": 64, "llama.embedding_length": hidden, "llama.block_count": layers,
        "llama.feed_forward_length": 2 * hidden, "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": kv_heads, "tokenizer.ggml.eos_token_id": eos,
        **(numbers or {}),
    }  # fmt: skip
    for key, value in settings.items():
        writer.add_uint32(key, value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(tokens)])
    writer.add_tensor("token_embd.weight", np.zeros((max(tokens, 1), hidden), np.float32))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", np.zeros((hidden, hidden), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _value_at(data: bytes, key: str) -> int:
    """The byte where setting `key`'s value begins (past its name and value type)."""
    return data.index(key.encode()) + len(key) + 4


def _patched(path, at: int, form: str, *values) -> None:
    data = bytearray(path.read_bytes())
    struct.pack_into("<" + form, data, at, *values)
    path.write_bytes(bytes(data))


@pytest.fixture
def no_reader(monkeypatch):
    """gguf's reader, which transformers parses a .gguf with, fails the test if used."""

    def reader(*args, **kwargs):
        raise AssertionError("gguf's reader saw a file our checks should have refused")

    monkeypatch.setattr(gguf, "GGUFReader", reader)


def _refused(path, needle: str) -> str:
    """`path` refused by the header check, by the float32 conversion and by the stored
    path alike, quickly and in one line naming `needle`; gguf's reader never runs."""
    started = time.perf_counter()
    with pytest.raises(ModelError, match=needle) as info:
        check_gguf_header(path)
    assert time.perf_counter() - started < 1.0
    message = str(info.value)
    assert "\n" not in message
    for quantization in (None, "gguf"):
        with pytest.raises(ModelError, match=needle):
            sources.resolve_model(path, quantization=quantization, kernels="gguf")
    return message


def test_a_well_formed_file_passes(tmp_path):
    header = check_gguf_header(_tiny(tmp_path / "m.gguf"))
    assert header.arch == "llama" and header.numbers["llama.block_count"] == 2
    assert header.arrays["tokenizer.ggml.tokens"] == (8, 4)
    assert [t.name for t in header.tensors][:2] == ["token_embd.weight", "blk.0.attn_norm.weight"]


def test_a_billion_blocks_is_refused_at_the_layer_limit(tmp_path, no_reader):
    path = _tiny(tmp_path / "m.gguf", numbers={"llama.block_count": 10**9})
    _refused(path, r"llama\.block_count=1000000000 is out of range: layers must be 1 to 4096")


@pytest.mark.parametrize("count", [1, 3000])
def test_a_block_count_other_than_the_blocks_held_is_refused(tmp_path, no_reader, count):
    path = _tiny(tmp_path / "m.gguf", numbers={"llama.block_count": count})
    _refused(
        path, rf"llama\.block_count={count}, but its tensors are of blocks 0 to 1: it must be 2"
    )


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("llama.embedding_length", 2**21, r"embedding_length=2097152 is out of range: hidden"),
        ("llama.context_length", 0, r"context_length=0 is out of range: positions must be 1"),
        ("llama.feed_forward_length", 2**30, r"feed_forward_length=1073741824 is out of range"),
        ("llama.attention.key_length", 0, r"key_length=0 is out of range: heads must be 1 to"),
    ],
)
def test_a_size_beyond_its_config_limit_is_refused(tmp_path, no_reader, key, value, needle):
    _refused(_tiny(tmp_path / "m.gguf", numbers={key: value}), needle)


def test_an_array_of_2_62_items_is_refused_without_walking_it(tmp_path, no_reader):
    path = _tiny(tmp_path / "m.gguf")
    at = _value_at(path.read_bytes(), "tokenizer.ggml.tokens") + 4  # (past the item type)
    _patched(path, at, "Q", 2**62)
    _refused(path, r"setting 'tokenizer\.ggml\.tokens' is an array of 4611686018427387904 items")


def test_a_string_of_2_62_bytes_is_refused(tmp_path, no_reader):
    path = _tiny(tmp_path / "m.gguf")
    _patched(path, _value_at(path.read_bytes(), "tokenizer.ggml.model"), "Q", 2**62)
    _refused(path, r"a string of setting 'tokenizer\.ggml\.model' has a length of 4611686018")


@pytest.mark.parametrize("off_by", [3, -3])
def test_a_settings_count_off_by_three_is_refused(tmp_path, no_reader, off_by):
    path = _tiny(tmp_path / "m.gguf")
    (count,) = struct.unpack_from("<Q", path.read_bytes(), 16)
    _patched(path, 16, "Q", count + off_by)
    _refused(path, r"damaged or truncated|not UTF-8|dimensions; GGUF allows")


def test_an_eos_token_beyond_the_vocabulary_is_refused(tmp_path, no_reader):
    path = _tiny(tmp_path / "m.gguf", tokens=4, eos=4)
    _refused(path, r"tokenizer\.ggml\.eos_token_id=4 is not a token of its 4: it must be 0 to 3")


def test_an_empty_token_list_is_refused(tmp_path, no_reader):
    path = _tiny(tmp_path / "m.gguf", tokens=0, eos=0)  # (the writer leaves it out)
    _refused(path, r"tokenizer\.ggml\.tokens holds 0 items .* must hold 1 to 16777216 strings")
    path = _tiny(tmp_path / "m.gguf", tokens=1, eos=0)
    at = _value_at(path.read_bytes(), "tokenizer.ggml.tokens") + 4  # (past the item type)
    _patched(path, at, "Q", 0)  # (its one string is then read as the first tensor's name)
    _refused(path, r"tensor 't0' has \d+ dimensions; GGUF allows 1 to 4")


@pytest.mark.parametrize(
    ("heads", "needle"),
    [
        (0, r"head_count=0; a model needs at least 1 head"),
        (3, r"head_count=3 does not divide llama\.embedding_length=8"),
    ],
)
def test_heads_that_do_not_divide_the_hidden_size_are_refused(tmp_path, no_reader, heads, needle):
    _refused(_tiny(tmp_path / "m.gguf", heads=heads, kv_heads=1), needle)


def test_key_value_heads_that_do_not_divide_the_heads_are_refused(tmp_path, no_reader):
    path = _tiny(tmp_path / "m.gguf", heads=4, kv_heads=3)
    _refused(path, r"head_count_kv=3: it must divide llama\.attention\.head_count=4")


def test_overlapping_tensors_are_refused(tmp_path, no_reader):
    path = _tiny(tmp_path / "m.gguf")
    data = path.read_bytes()
    name = b"blk.1.attn_q.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8 + 4  # (past dims count, 2 dims, type)
    _patched(path, at, "Q", 0)  # (where the embedding is)
    _refused(path, r"tensors 'token_embd\.weight' and 'blk\.1\.attn_q\.weight' overlap")


def test_a_tensor_of_five_dimensions_is_refused(tmp_path, no_reader):
    path = _tiny(tmp_path / "m.gguf")
    data = path.read_bytes()
    _patched(path, data.index(b"blk.0.attn_norm.weight") + 22, "I", 5)
    _refused(path, r"tensor 'blk\.0\.attn_norm\.weight' has 5 dimensions; GGUF allows 1 to 4")


def test_a_count_given_as_a_float_is_refused(tmp_path, no_reader):
    path = _tiny(tmp_path / "m.gguf")
    at = _value_at(path.read_bytes(), "llama.block_count")
    _patched(path, at - 4, "If", 6, 2.0)  # (type float32)
    _refused(path, r"llama\.block_count=2\.0; it must be an integer")


def test_a_tensor_of_a_type_gguf_does_not_have_is_refused(tmp_path, no_reader):
    path = _tiny(tmp_path / "m.gguf")
    data = path.read_bytes()
    at = data.index(b"blk.0.attn_norm.weight") + 22 + 4 + 8  # (past its one dimension)
    _patched(path, at, "I", 2**31)
    _refused(path, r"tensor 'blk\.0\.attn_norm\.weight' is of GGUF type 2147483648; the types")


def _both_paths_refuse(path, needle: str) -> None:
    """`path` refused by the float32 conversion and the stored path, in one line naming
    `needle`, before transformers reads it."""
    for quantization in (None, "gguf"):
        with pytest.raises(ModelError, match=needle) as info:
            sources.resolve_model(path, quantization=quantization, kernels="gguf")
        assert "\n" not in str(info.value) and "float32" not in str(info.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_float_tensor_holding_nan_or_inf_is_named(tmp_path, no_reader, value):
    path = _tiny(tmp_path / "m.gguf")
    norm = next(t for t in check_gguf_header(path).tensors if t.name == "blk.1.attn_norm.weight")
    _patched(path, norm.offset + 4 * 3, "f", value)
    _both_paths_refuse(path, r"tensor 'blk\.1\.attn_norm\.weight' \(F32\) holds 1 nan or inf val")


def test_a_quantized_block_with_a_nan_scale_is_named(tmp_path, no_reader):
    """As a tensor read from the wrong bytes: a block's fp16 scale that is not finite."""
    from gguf_files import write_llama_gguf

    path = write_llama_gguf(tmp_path / "m.gguf", kind="Q4_0")
    up = next(t for t in check_gguf_header(path).tensors if t.name == "blk.0.ffn_up.weight")
    _patched(path, up.offset + 18 * 5, "H", 0x7E00)  # (block 5's scale: a float16 nan)
    _both_paths_refuse(path, r"'blk\.0\.ffn_up\.weight' \(Q4_0\) holds 1 nan or inf block scales")


@pytest.mark.parametrize(
    ("numbers", "needle"),
    [
        (
            {"llama.embedding_length": 16},
            r"'token_embd\.weight' has dimensions \[8, 4\]; the file's settings \(hidden 16,",
        ),
        (
            {"llama.attention.key_length": 8},  # (2 heads of 8: the queries 16 wide)
            r"'blk\.0\.attn_q\.weight' has dimensions \[8, 8\]; .* make \[8, 16\]",
        ),
    ],
)
def test_tensors_of_other_sizes_than_the_settings_say_are_refused(
    tmp_path, no_reader, numbers, needle
):
    _refused(_tiny(tmp_path / "m.gguf", numbers=numbers), needle)


@pytest.mark.parametrize(
    ("more", "needle"),
    [
        (
            lambda w: w.add_float32("llama.attention.layer_norm_rms_epsilon", float("nan")),
            r"llama\.attention\.layer_norm_rms_epsilon=nan; it must be a finite number above 0",
        ),
        (
            lambda w: w.add_float32("llama.rope.freq_base", 0.0),
            r"llama\.rope\.freq_base=0\.0; it must be a finite number above 0",
        ),
        (
            lambda w: w.add_uint32("llama.rope.dimension_count", 3),
            r"llama\.rope\.dimension_count=3; it must be the head size, 4",
        ),
        (
            lambda w: w.add_string("llama.expert_count", "many"),
            r"llama\.expert_count is not a number; it must be an integer",
        ),
    ],
    ids=["nan epsilon", "zero rotary base", "rotary dimensions", "a string count"],
)
def test_settings_that_make_every_logit_nan_or_are_not_numbers_are_refused(
    tmp_path, no_reader, more, needle
):
    _refused(_tiny(tmp_path / "m.gguf", more=more), needle)


def test_a_quantized_vector_is_refused(tmp_path, no_reader):
    path = _tiny(tmp_path / "m.gguf", hidden=32)
    data = path.read_bytes()
    at = data.index(b"blk.0.attn_norm.weight") + 22 + 4 + 8  # (past its one dimension)
    _patched(path, at, "I", 2)  # (Q4_0: the norm's 32 floats read as blocks)
    _refused(path, r"'blk\.0\.attn_norm\.weight' is a vector of Q4_0 blocks; a vector is stored")


def test_a_tokenizer_transformers_cannot_build_is_one_line_naming_the_file(tmp_path):
    """A merge of one token: the tokenizers library raises a bare Exception for it."""
    path = _tiny(tmp_path / "m.gguf", more=lambda w: w.add_token_merges(["t0"]))
    for quantization in (None, "gguf"):
        with pytest.raises(ModelError, match=r"m\.gguf.*: transformers cannot read its tokenizer"):
            sources.resolve_model(path, quantization=quantization, kernels="gguf")


def test_more_strings_than_any_tokenizer_has_are_refused_before_they_are_read(
    tmp_path, no_reader, monkeypatch
):
    """gguf's reader takes ~20 us a string: a file of 10^7 one-byte tokens (~90 MB) would
    take minutes; the limit is lowered here so that the test's file stays small."""
    from offload.model import gguf_read

    monkeypatch.setattr(gguf_read, "MAX_STRINGS", 3)
    path = _tiny(tmp_path / "m.gguf", tokens=4, eos=1)
    _refused(path, r"arrays hold more than 3 strings \(setting 'tokenizer\.ggml\.tokens' has 4\)")
