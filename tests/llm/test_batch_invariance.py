"""Batch invariance (`LLM(batch_invariant=True)`, vLLM's VLLM_BATCH_INVARIANT=1): a prompt's
tokens and logprobs are bit for bit the same alone and in any batch, whatever the other
prompts' lengths and order, on every weight form (float32, bfloat16, GGUF as stored,
packed checkpoints), in `generate` and among concurrent streams (what `serve` runs). The
default model is cut to its first blocks (tests/short_model.py)."""

from __future__ import annotations

import gguf_files
import packed_zoo
import pytest
import torch
from streams import answer_of, check_invariant, random_prompts, streamed_apart

from offload import LLM, SamplingParams
from offload.engine import invariant
from offload.errors import ConfigError

PARAMS = SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True)
LENGTHS = (1, 2, 3, 5, 9, 30)  # prompt lengths in tokens (batches of 1-6 rows: each tail of 4)


def _prompts(vocab: int, seed: int = 0) -> list[dict]:
    return random_prompts(vocab, LENGTHS, seed)


_answer = answer_of


def _check_invariant(llm: LLM, vocab: int) -> None:
    check_invariant(llm, _prompts(vocab), PARAMS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "stored"])
def test_the_default_model_answers_alike_alone_and_in_any_batch(short_gguf, dtype):
    kwargs = {} if dtype == "stored" else {"dtype": dtype}
    with LLM(short_gguf, batch_invariant=True, max_model_len=128, **kwargs) as llm:
        _check_invariant(llm, llm.model.config.vocab_size)


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0"])
def test_a_gguf_as_stored_answers_alike_alone_and_in_any_batch(tmp_path, kind):
    path = gguf_files.write_llama_gguf(tmp_path / f"tiny-{kind}.gguf", kind=kind)
    with LLM(str(path), batch_invariant=True, max_model_len=64) as llm:
        _check_invariant(llm, 257)


@pytest.mark.parametrize("fmt", ["gptq", "ct-w4a16", "fp8-block"])
def test_a_packed_checkpoint_answers_alike_alone_and_in_any_batch(tmp_path, fmt):
    quantized, _ = packed_zoo.save_pair(tmp_path, fmt)
    with LLM(quantized, device="cpu", batch_invariant=True, max_model_len=64) as llm:
        _check_invariant(llm, llm.model.config.vocab_size)


def test_an_offloaded_model_answers_as_resident_alone_and_in_batches(short_gguf):
    prompts = _prompts(49152)[1:]
    with LLM(short_gguf, dtype="float32", batch_invariant=True, max_model_len=128) as llm:
        resident = [_answer(o) for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    offloaded = LLM(
        short_gguf,
        dtype="float32",
        batch_invariant=True,
        max_model_len=128,
        offload_backend="prefetch",
        offload_group_size=2,
        offload_num_in_group=1,
    )
    with offloaded as llm:
        together = [_answer(o) for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
        alone = [_answer(llm.generate([p], PARAMS, use_tqdm=False)[0]) for p in prompts[:3]]
        assert llm.transfer_stats().weight_copied_bytes > 0
    assert together == resident and alone == resident[:3]


def test_concurrent_streams_answer_as_generate_does_alone(short_gguf):
    """What `offload serve` runs: requests from several threads, joining the batch at
    different steps, each answered as `generate` answers it alone."""
    with LLM(short_gguf, dtype="float32", batch_invariant=True, max_model_len=128) as llm:
        prompts = _prompts(llm.model.config.vocab_size, seed=2)
        alone = [_answer(llm.generate([p], PARAMS, use_tqdm=False)[0]) for p in prompts]
        assert streamed_apart(llm, prompts, PARAMS, _answer) == alone


def test_the_products_are_padded_to_a_multiple_that_rounds_every_row_alike():
    """The probe's multiple holds for rows of any values in any place (the repeated row it
    tries stands for them), and the padded linear gives a row's bits whatever the count
    (on this machine's MKL, float32 rows round apart alone, among 2-3 and past a block of 4)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 40, bias=False)
    multiple = invariant.row_multiple(linear, torch.device("cpu"), torch.float32)
    invariant.pad_products(linear, multiple)
    x = torch.randn(23, 96)
    with torch.inference_mode(), invariant.decoding(1):  # (padded in decode steps only)
        alone = [linear(x[i : i + 1])[0] for i in range(len(x))]
        for rows in (2, 3, 5, 6, 11, 23):
            out = linear(x[:rows])
            assert all(torch.equal(out[i], alone[i]) for i in range(rows))


def test_batch_invariant_is_checked_before_the_model_loads(monkeypatch):
    with pytest.raises(ConfigError, match=r"batch_invariant must be True or False"):
        LLM("/nonexistent", batch_invariant="yes")
    with pytest.raises(ConfigError, match=r"leave kv_offload and swap_space unset"):
        LLM("/nonexistent", batch_invariant=True, kv_offload=True)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")  # vLLM's switch sets the default
    with pytest.raises(ConfigError, match=r"leave kv_offload and swap_space unset"):
        LLM("/nonexistent", swap_space=1)
