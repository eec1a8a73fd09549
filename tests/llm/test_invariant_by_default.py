"""Batch invariance by default on a CPU (`quant/row_dot`): with no flag, a prompt's tokens
and logprobs are bit for bit the same alone and in any batch, whatever the other prompts'
lengths and order, on every weight form, eager and compiled, in `generate` and among
concurrent streams (what `serve` runs). The default model is cut to its first blocks
(tests/short_model.py): its kinds, shapes and products are the whole model's."""

from __future__ import annotations

import gguf_files
import packed_zoo
import pytest
from streams import answer_of, check_invariant, random_prompts, streamed_apart

from offload import LLM, SamplingParams
from offload.engine import cpu_linear
from offload.quant import row_dot

PARAMS = SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True)
LENGTHS = (1, 2, 3, 5, 9, 30)  # prompt lengths in tokens (batches of 1-6 rows: each tail of 4)


def _check_invariant(llm: LLM, vocab: int) -> None:
    check_invariant(llm, random_prompts(vocab, LENGTHS), PARAMS)


@pytest.fixture(autouse=True)
def _kernels_built():
    if row_dot.library() is None:
        pytest.skip("no C compiler here: the row-invariant products are not built")


@pytest.mark.parametrize("dtype", ["float32", "stored", "bfloat16", "float16"])
def test_the_default_model_answers_alike_alone_and_in_any_batch(short_gguf, dtype):
    kwargs = {} if dtype == "stored" else {"dtype": dtype}
    with LLM(short_gguf, max_model_len=128, enable_prefix_caching=False, **kwargs) as llm:
        _check_invariant(llm, llm.model.config.vocab_size)


def _sharing_prompts(vocab: int, seed: int) -> list[dict]:
    """Prompts of random token ids, most beginning with one of two shared prefixes (one
    past 64 tokens: more than `cpu_linear.MAX_ROWS`), so that held prefixes are reused."""
    shared = [p["prompt_token_ids"] for p in random_prompts(vocab, (20, 90), seed)]
    tails = [p["prompt_token_ids"] for p in random_prompts(vocab, (1, 3, 17, 40), seed + 1)]
    ids = [s + t for s in shared for t in tails] + tails[2:] + [shared[1] * 2]
    return [{"prompt_token_ids": p} for p in ids]


@pytest.mark.parametrize("dtype", ["stored", "float32", "bfloat16"])
def test_a_prompt_answers_alike_after_a_held_prefix_and_in_chunks(short_gguf, dtype):
    """With prefix caching on (the default) and prompts prefilled in chunks of 16 tokens
    (riding in decode steps), each prompt's answer is bit for bit its answer alone with
    no cache: a position's attention and products do not depend on where its prompt was
    cut (`engine/prompt_attention`; ATen's attention parted after a held prefix)."""
    kwargs = {} if dtype == "stored" else {"dtype": dtype}
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    with LLM(
        short_gguf, max_model_len=256, enable_prefix_caching=False, enforce_eager=True, **kwargs
    ) as llm:
        prompts = _sharing_prompts(llm.model.config.vocab_size, seed=5)
        alone = [answer_of(llm.generate([p], params, use_tqdm=False)[0]) for p in prompts]
    with LLM(
        short_gguf, max_model_len=256, max_num_batched_tokens=16, enforce_eager=True, **kwargs
    ) as llm:
        together = [answer_of(o) for o in llm.generate(prompts, params, use_tqdm=False)]
        held = llm.generate(prompts[::-1], params, use_tqdm=False)[::-1]  # (all held now)
        hits = llm._generator.core.scheduler.prefixes.hits
    assert together == alone
    assert [answer_of(o) for o in held] == alone
    assert hits >= sum(len(p["prompt_token_ids"]) - 1 for p in prompts) > 600


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_of_more_than_64_rows_answers_as_alone(short_gguf, dtype):
    """70 prompts at once (the server's default `max_num_seqs` is 256): each answer is its
    answer alone (MKL's and oneDNN's products above `cpu_linear.MAX_ROWS` rows parted
    every one of them in float32)."""
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)
    with LLM(
        short_gguf, max_model_len=64, enforce_eager=True, dtype=dtype, enable_prefix_caching=False
    ) as llm:
        lengths = [2 + i % 20 for i in range(70)]
        prompts = random_prompts(llm.model.config.vocab_size, lengths, seed=6)
        together = [answer_of(o) for o in llm.generate(prompts, params, use_tqdm=False)]
        alone = [answer_of(llm.generate([p], params, use_tqdm=False)[0]) for p in prompts[:5]]
    assert together[:5] == alone


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0"])
def test_a_gguf_as_stored_answers_alike_alone_and_in_any_batch(tmp_path, kind):
    path = gguf_files.write_llama_gguf(tmp_path / f"tiny-{kind}.gguf", kind=kind)
    with LLM(str(path), max_model_len=64, enable_prefix_caching=False) as llm:
        _check_invariant(llm, 257)


@pytest.mark.parametrize("fmt", ["gptq", "fp8-block"])
def test_a_packed_checkpoint_answers_alike_alone_and_in_any_batch(tmp_path, fmt):
    quantized, _ = packed_zoo.save_pair(tmp_path, fmt)
    with LLM(quantized, device="cpu", max_model_len=64, enable_prefix_caching=False) as llm:
        _check_invariant(llm, llm.model.config.vocab_size)


def test_concurrent_streams_answer_as_generate_does_alone(short_gguf):
    with LLM(short_gguf, max_model_len=128, enable_prefix_caching=False) as llm:
        prompts = random_prompts(llm.model.config.vocab_size, LENGTHS, seed=2)
        alone = [answer_of(llm.generate([p], PARAMS, use_tqdm=False)[0]) for p in prompts]
        assert streamed_apart(llm, prompts, PARAMS, answer_of) == alone


def test_the_compiled_step_answers_alike_alone_and_in_any_batch(short_gguf, monkeypatch):
    """One compiled graph for every batch (a lone row beside a padding row), waited for:
    the default model as stored, cut to its first 4 layers (its own blocks and kinds, its
    q8 head; the whole model's step takes ~60 s to compile here, and the graph's kinds do
    not change with its depth), answers alike alone and batched, bit for bit, over widths
    up to 256 columns (a lone row's own graph parted from a batch's in every answer's
    logprobs, on the whole model)."""
    monkeypatch.setenv("OFFLOAD_CPU_COMPILE", "wait")
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    with LLM(short_gguf, max_model_len=256, enable_prefix_caching=False) as llm:
        prompts = random_prompts(llm.model.config.vocab_size, (3, 30, 61, 120), seed=3)
        check_invariant(llm, prompts, params)
        assert llm._cpu_step is not None and set(llm._cpu_step.graphs) == {("rows",)}


def test_a_compiled_step_of_de_quantized_products_answers_alike(tmp_path, monkeypatch):
    """A packed form (and a GGUF kind kept as its blocks) de-quantizes for `F.linear`
    inside its opaque op: in a compiled step too that product is the row-invariant one
    (with `F.linear` there, this GPTQ model's answers parted)."""
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("OFFLOAD_CPU_COMPILE", "wait")
    monkeypatch.setattr(cpu_linear, "PAYS_BYTES", 0)  # (the tiny model's step compiles)
    path, _ = packed_zoo.save_pair(tmp_path, "gptq")
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    with LLM(path, device="cpu", max_model_len=128, enable_prefix_caching=False) as llm:
        prompts = random_prompts(llm.model.config.vocab_size, (1, 3, 9, 30, 70), seed=4)
        check_invariant(llm, prompts, params)
        assert llm._cpu_step is not None and set(llm._cpu_step.graphs) == {("rows",)}
