"""A prompt's prefill does not depend on its batch, in the default mode: its prompt
logprobs and its first token's logprobs are bit for bit the same alone and beside prompts
of any lengths, on every weight form, offloaded or not, in `generate` and among
concurrent streams (what `serve` runs); the default model cut to its first blocks
(tests/short_model.py). (The decode steps after it are batched: their
products may round apart by the batch; `batch_invariant=True` covers those,
`test_batch_invariance.py`.)"""

from __future__ import annotations

import random

import gguf_files
import packed_zoo
import pytest
from streams import random_prompts, streamed_apart

from offload import LLM, SamplingParams

pytestmark = pytest.mark.slow

FIRST = SamplingParams(temperature=0, max_tokens=1, logprobs=4, prompt_logprobs=2)
# (without prompt logprobs, prompts admitted together prefill in one forward on a CPU)
PACKED = SamplingParams(temperature=0, max_tokens=1, logprobs=4)
LENGTHS = (7, 1, 30, 3, 12, 2)  # prompt lengths in tokens, the longest not last


def _prompts(vocab: int, seed: int = 0) -> list[dict]:
    return random_prompts(vocab, LENGTHS, seed)


def _first(output) -> tuple:
    """The prompt logprobs and the first token with its logprobs."""
    completion = output.outputs[0]
    prompt = tuple(
        None if step is None else tuple(sorted((t, e.logprob) for t, e in step.items()))
        for step in output.prompt_logprobs or ()
    )
    first = tuple(sorted((t, e.logprob) for t, e in completion.logprobs[0].items()))
    return prompt, completion.token_ids[0], first


def _check_alike(llm: LLM, vocab: int, params: SamplingParams = FIRST) -> list[tuple]:
    prompts = _prompts(vocab)
    alone = [_first(llm.generate([p], params, use_tqdm=False)[0]) for p in prompts]
    together = [_first(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert together == alone
    order = list(range(len(prompts)))
    random.Random(1).shuffle(order)
    some = order[: len(order) - 2]  # another mix: shuffled, two left out, one twice
    mixed = llm.generate([prompts[i] for i in [*some, some[0]]], params, use_tqdm=False)
    assert [_first(o) for o in mixed] == [alone[i] for i in [*some, some[0]]]
    if params is FIRST:
        packed = llm.generate([prompts[i] for i in [*some, some[0]]], PACKED, use_tqdm=False)
        assert [_first(o)[1:] for o in packed] == [alone[i][1:] for i in [*some, some[0]]]
    return alone


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "stored"])
def test_the_default_model_prefills_alike_alone_and_in_any_batch(short_gguf, dtype):
    kwargs = {} if dtype == "stored" else {"dtype": dtype}
    with LLM(short_gguf, max_model_len=128, **kwargs) as llm:
        _check_alike(llm, llm.model.config.vocab_size)


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0"])
def test_a_gguf_as_stored_prefills_alike_alone_and_in_any_batch(tmp_path, kind):
    path = gguf_files.write_llama_gguf(tmp_path / f"tiny-{kind}.gguf", kind=kind)
    with LLM(str(path), max_model_len=64) as llm:
        _check_alike(llm, 257)


@pytest.mark.parametrize("fmt", ["gptq", "fp8-block"])
def test_a_packed_checkpoint_prefills_alike_alone_and_in_any_batch(tmp_path, fmt):
    quantized, _ = packed_zoo.save_pair(tmp_path, fmt)
    with LLM(quantized, device="cpu", max_model_len=64) as llm:
        _check_alike(llm, llm.model.config.vocab_size)


def test_offloaded_weights_and_kv_prefill_as_resident_alone(short_gguf):
    with LLM(short_gguf, dtype="float32", max_model_len=128) as llm:
        resident = _check_alike(llm, 49152)
    for kwargs in (
        {"offload_backend": "prefetch", "offload_group_size": 2, "offload_num_in_group": 1},
        {"kv_offload": True},
    ):
        with LLM(short_gguf, dtype="float32", max_model_len=128, **kwargs) as llm:
            assert _check_alike(llm, 49152) == resident
            stats = llm.transfer_stats()
            assert stats.weight_copied_bytes + stats.kv_copied_bytes > 0


def test_concurrent_streams_begin_as_generate_does_alone(short_gguf):
    """Requests from several threads, joining the running batch at different steps: each
    one's first token and its logprobs as `generate` gives them alone."""
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=4, ignore_eos=True)
    with LLM(short_gguf, dtype="bfloat16", max_model_len=128) as llm:
        prompts = _prompts(llm.model.config.vocab_size, seed=2)

        def first(output) -> tuple:
            completion = output.outputs[0]
            step = completion.logprobs[0]
            return completion.token_ids[0], tuple(sorted((t, e.logprob) for t, e in step.items()))

        alone = [first(llm.generate([p], params, use_tqdm=False)[0]) for p in prompts]
        assert streamed_apart(llm, prompts, params, first) == alone
