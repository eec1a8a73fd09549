"""A .gguf of another architecture than the default model's Llama read as stored: Qwen2,
whose attention has biases (and whose query and key rows llama.cpp leaves in
transformers' order), written as llama.cpp writes one: as stored it gives the tokens of
its float32 conversion (transformers' reader), logprobs to the sums' order, and of the
float32 model it was quantized from at most a few tokens apart; offloaded it gives its
resident bits. (`zoo.save_random_gguf` writes Llama too, its rows permuted: checked by
hand, 2026-11-28; the default model's file is a Llama.)"""

from __future__ import annotations

import pytest
import torch
import zoo

from offload import LLM, SamplingParams
from offload.model.gguf_fast import FastReader

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
PROMPT = {"prompt_token_ids": [1, 5, 9, 14, 3, 27, 100, 2000]}


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """(the .gguf's path, the float32 model it was made from)."""
    return zoo.save_random_gguf(tmp_path_factory.mktemp("qwen2") / "qwen2.gguf", "qwen2")


def _run(llm):
    [out] = llm.generate(PROMPT, PARAMS, use_tqdm=False)
    completion = out.outputs[0]
    llm.close()
    return completion.token_ids, [next(iter(s.values())).logprob for s in completion.logprobs]


def test_a_qwen2_gguf_runs_as_stored(qwen2):
    path, source = qwen2
    stored = LLM(str(path), device="cpu", enforce_eager=True)
    # (as stored: its blocks or the q8 kernel's layout, whichever timed faster here)
    assert type(stored.model.model.layers[0].mlp.up_proj).__name__ in ("Q8Linear", "GGUFLinear")
    assert stored.model.model.layers[0].self_attn.q_proj.bias is not None
    tokens, logprobs = _run(stored)
    floats = _run(LLM(str(path), device="cpu", enforce_eager=True, dtype="float32"))
    assert tokens == floats[0]
    # (a VNNI CPU's q8 products sum integers, the inputs rounded to 15 bits: 2.4e-4 seen)
    assert max(abs(a - b) for a, b in zip(logprobs, floats[1], strict=True)) < 1e-3
    with torch.no_grad():  # (the model it was quantized from: Q8_0 moves little)
        ids = torch.tensor([PROMPT["prompt_token_ids"] + tokens[:-1]])
        expected = source(input_ids=ids).logits[0, -len(tokens) :].argmax(-1).tolist()
    assert sum(a == b for a, b in zip(tokens, expected, strict=True)) >= len(tokens) - 2
    offloaded = _run(LLM(str(path), device="cpu", enforce_eager=True, cpu_memory_gb=0))
    assert offloaded == (tokens, logprobs)


def test_a_gguf_of_a_type_not_read_as_stored_runs_as_its_float32_conversion(qwen2, tmp_path):
    """A file with a tensor type that has no reader here (an IQ type): by default its
    float32 conversion runs, with a warning saying why; asked for as stored, one error
    line naming the type and the way out."""
    import gguf
    import numpy as np

    from offload.errors import OffloadError

    reader = FastReader(qwen2[0])
    writer = gguf.GGUFWriter(tmp_path / "iq.gguf", "qwen2")
    for key, field in reader.fields.items():
        if not key.startswith(("GGUF.", "general.architecture")):
            sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:  # (one weight's type renamed: the reader refuses it first)
        iq = tensor.name == "blk.0.attn_k.weight"
        data = np.zeros((tensor.data.shape[0], 136), np.uint8) if iq else tensor.data
        kind = gguf.GGMLQuantizationType.IQ4_XS if iq else tensor.tensor_type
        writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(OffloadError, match=r"IQ4_XS, not read as stored yet.*--dtype float32"):
        LLM(str(tmp_path / "iq.gguf"), device="cpu", quantization="gguf")
    with pytest.warns(UserWarning, match=r"IQ4_XS, not read as stored yet.*float32 conversion"):
        from offload.model.sources import stored_unless_asked

        assert stored_unless_asked(tmp_path / "iq.gguf", None, "auto", torch.device("cpu")) is None


def test_the_header_alone_names_the_architecture_and_types_as_ggufs_reader_does(qwen2, tmp_path):
    """Whether a .gguf is read as stored is decided from its header alone (every LLM of a
    .gguf asks; gguf's reader took 2 s a time): the same architecture, tensor names,
    types, shapes and byte ranges as the reader's, on the shipped file and a Qwen2 one; a
    cut file is refused."""
    import struct

    import gguf

    from offload.model.default import gguf_path
    from offload.model.gguf_header import gguf_tensors
    from offload.model.gguf_stored import gguf_header

    for path in (gguf_path(), qwen2[0]):
        reader = gguf.GGUFReader(path)
        arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
        types = [(tensor.name, tensor.tensor_type.name) for tensor in reader.tensors]
        assert gguf_header(path) == (arch, types)
        ranges = [(t.name, t.data.shape, t.data_offset, t.n_bytes) for t in reader.tensors]
        found = gguf_tensors(path)[1]  # (and where each tensor's bytes are)
        assert [(t.name, t.shape, t.offset, t.num_bytes) for t in found] == ranges
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(qwen2[0].read_bytes()[:200_000])  # (inside the tokenizer's settings)
    with pytest.raises((struct.error, ValueError)):
        gguf_header(cut)
