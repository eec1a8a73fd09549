"""The compiled CPU step gives the eager step's bits beyond Llama's shape: a layer norm and
GELU (GPT-NeoX), a norm of (1 + weight) and tanh-GELU (Gemma), a mixture of experts' routing
(Qwen3-MoE). (All nine of `zoo`'s causal architectures agreed in float32 and bf16 when
measured, 2026-11-30; these three stand for them.)"""

from __future__ import annotations

import pytest
import zoo
from streams import answer_of, random_prompts

from offload import LLM, SamplingParams
from offload.engine import cpu_linear, cpu_step
from offload.quant import row_dot

PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)


@pytest.mark.parametrize("arch", ["gpt_neox", "gemma", "qwen3_moe"])
def test_compiled_and_eager_answers_are_bit_for_bit_alike(arch, tmp_path, monkeypatch):
    if row_dot.library() is None:
        pytest.skip("no C compiler here: the eager step's products are MKL's")
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_linear, "PAYS_BYTES", 0)  # (the tiny model's step compiles)
    path = tmp_path / arch
    zoo.save_with_tokenizer(zoo.build(arch), path)
    prompts = random_prompts(zoo.VOCAB, (3, 9, 17), seed=2)
    with LLM(str(path), device="cpu", max_model_len=48, enforce_eager=True) as llm:
        eager = [answer_of(o) for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    monkeypatch.setenv(cpu_step.ENV, "wait")  # (every decode step compiled)
    with LLM(str(path), device="cpu", max_model_len=48) as llm:
        compiled = [answer_of(o) for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
        assert llm.transfer_stats().num_compiled_steps == PARAMS.max_tokens - 1
    assert compiled == eager
