"""The packed step (`engine/packed_step.py`): a turn's decode rows and prompt tokens as one
forward of tokens each over its own row, compiled as one graph of any length. Its
attention gives each token the bits of its decode step or its prefill alone, and its
answers are the answers alone, eager and compiled."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from streams import RIDING_LENGTHS, RIDING_STOPS, answer_of, random_prompts

import offload.llm.cores as cores
from offload import LLM, SamplingParams
from offload.engine import compiled_step, cpu_linear, cpu_step, packed_step, prompt_attention
from offload.engine.chunk_pace import ChunkPace
from offload.engine.cpu_linear import kernels_for
from offload.quant import row_dot

LENGTHS, STOPS = RIDING_LENGTHS, RIDING_STOPS


@pytest.fixture(autouse=True)
def _kernels_built():
    if row_dot.library() is None:
        pytest.skip("no C compiler here: no packed steps")


def test_runs_group_a_rows_tokens_and_leave_single_rows_together():
    assert packed_step._runs([0, 1, 2]) == [(0, 3, False)]
    assert packed_step._runs([0, 1, 5, 5, 5, 2, 7, 7]) == [
        (0, 2, False), (2, 5, True), (5, 6, False), (6, 8, True),
    ]  # fmt: skip
    assert packed_step._runs([4, 4]) == [(0, 2, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_token_has_the_bits_of_its_decode_step_and_of_its_prompt_alone(dtype):
    """Decode rows (each a row of its own), a prompt's chunk (one row's run of tokens) and
    another row's lone token, packed: each token's output is the one the prompt kernel
    gives it alone, and the one it gives a whole chunk's queries together."""
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, columns = 6, 2, 16, 48
    keys, values = (
        torch.randn(5, kv_heads, columns, dim, generator=generator).to(dtype) for _ in range(2)
    )
    # (row, column, first column read): rows 0 and 1 decoding, a chunk of row 3, row 2
    tokens = [(0, 9, 0), (1, 30, 4), *[(3, c, 2) for c in range(11, 20)], (2, 17, 1)]
    rows = torch.tensor([r for r, _, _ in tokens])
    bounds = torch.tensor([[lo for _, _, lo in tokens], [c + 1 for _, c, _ in tokens]])
    query = torch.randn(1, heads, len(tokens), dim, generator=generator).to(dtype)
    packed = packed_step.ROW_ATTENTION(query, keys, values, bounds, rows, 0.25)

    def alone(q, row, lo, his):  # q [1, heads, queries, dim]
        mask = torch.zeros(1, 1, len(his), columns, dtype=torch.bool)
        for index, hi in enumerate(his):
            mask[0, 0, index, lo:hi] = True
        kv = keys[row : row + 1], values[row : row + 1]
        out = prompt_attention.attention(q, *kv, mask, scale=0.25, enable_gqa=True)
        return out[0].transpose(0, 1)  # [queries, heads, dim]

    for index, (row, column, lo) in enumerate(tokens):
        one = alone(query[:, :, index : index + 1], row, lo, [column + 1])
        assert torch.equal(packed[index : index + 1], one), index
    chunk = alone(query[:, :, 2:11], 3, 2, [c + 1 for c in range(11, 20)])
    assert torch.equal(packed[2:11], chunk)


class _EagerSteps:
    """A compiled step's stand-in that runs each packed step eagerly (with the products
    the compiled step takes) and leaves decode steps to the runner's eager path."""

    running = threading.Lock()
    compiling = False

    def __init__(self):
        self.packed = 0

    def usable(self, step) -> bool:
        return True

    def ready(self, step) -> bool:
        return True

    def __call__(self, step, checked_once: bool = False):
        if not isinstance(step, packed_step.PackedStep):
            return None
        self.packed += 1
        with kernels_for(step._model, torch.device("cpu")):
            return step()


def _params(max_tokens: int, prompt_logprobs: int | None) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, logprobs=2, ignore_eos=True,
        prompt_logprobs=prompt_logprobs,
    )  # fmt: skip


def _answer(output) -> tuple:
    """Its tokens and logprobs, and its prompt's logprobs."""
    return answer_of(output), repr(output.prompt_logprobs)


def _alone_and_together(llm, monkeypatch, seed: int):
    prompts = random_prompts(llm.model.config.vocab_size, LENGTHS, seed=seed)
    # (every third asks for its prompt's logprobs: each of its positions kept)
    params = [_params(n, 1 if i % 3 == 2 else None) for i, n in enumerate(STOPS)]
    alone = [
        _answer(llm.generate([p], q, use_tqdm=False)[0])
        for p, q in zip(prompts, params, strict=True)
    ]
    budgets = random.Random(seed)
    monkeypatch.setattr(
        ChunkPace, "budget", lambda self, waiting, decoding: budgets.choice((1, 3, 17, 40, 500))
    )
    together = [_answer(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    return alone, together


def test_eager_packed_steps_answer_as_alone(short_gguf, monkeypatch):
    """Prompts riding in decode steps as packed steps (run eagerly here), cut anywhere:
    every answer's tokens and logprobs are its answer alone."""
    steps = _EagerSteps()
    monkeypatch.setattr(cores, "compiled_step", lambda llm: steps)
    with LLM(
        short_gguf, max_model_len=256, max_num_seqs=4, enable_prefix_caching=False
    ) as llm:  # fmt: skip
        alone, together = _alone_and_together(llm, monkeypatch, seed=0)
        assert llm.model.config._attn_implementation_internal == packed_step.NAME
    assert together == alone
    assert steps.packed >= 3


def test_compiled_packed_steps_answer_as_alone_in_one_graph(short_gguf, monkeypatch, tmp_path):
    """The same, compiled: one graph for every token count, its calls compiled."""
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(cpu_step.ENV, "wait")
    monkeypatch.setattr(cpu_linear, "PAYS_BYTES", 0)
    counts = {}
    call = compiled_step.CompiledCpuStep.__call__

    def counted(self, step, checked_once=False):
        out = call(self, step, checked_once)
        if isinstance(step, packed_step.PackedStep) and out is not None:
            counts[step.input_ids.shape[1]] = counts.get(step.input_ids.shape[1], 0) + 1
        return out

    monkeypatch.setattr(compiled_step.CompiledCpuStep, "__call__", counted)
    with LLM(
        short_gguf, max_model_len=256, max_num_seqs=4, enable_prefix_caching=False
    ) as llm:  # fmt: skip
        alone, together = _alone_and_together(llm, monkeypatch, seed=1)
        compiled = llm._cpu_step
        assert compiled.graphs.get(("packed",), 1) == 1
    assert together == alone
    assert len(counts) >= 2  # (token counts of their own, one graph)


def test_a_model_that_does_not_pass_the_keywords_on_runs_the_eager_mixed_forward(
    short_gguf, monkeypatch, caplog
):
    """Where a model's layers drop the packed step's keywords, its attention meets the
    cache's every row without them: packed steps turn off, and the turn runs eagerly with
    the same answers."""
    from transformers import AttentionInterface

    steps = _EagerSteps()
    monkeypatch.setattr(cores, "compiled_step", lambda llm: steps)
    with LLM(
        short_gguf, max_model_len=256, max_num_seqs=4, enable_prefix_caching=False
    ) as llm:  # fmt: skip

        def dropping(module, query, key, value, mask, **kwargs):
            kept = {k: v for k, v in kwargs.items() if not k.startswith("offload_")}
            return packed_step.attention(module, query, key, value, mask, **kept)

        monkeypatch.setitem(AttentionInterface._global_mapping, packed_step.NAME, dropping)
        alone, together = _alone_and_together(llm, monkeypatch, seed=2)
    assert together == alone
    # (tried once: then off for the call's runner)
    assert steps.packed == 1 and "do not pass its keywords" in caplog.text
