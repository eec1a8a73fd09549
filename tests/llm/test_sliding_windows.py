"""Sliding-window attention on the engine core: every row sits at its own column, so each
row's window is measured from its own query (`rows.RowMasks`); answers are transformers'
own, for prompts of different lengths decoded together, offloaded or not."""

import pytest
import torch
import transformers as tf
import zoo

from offload import SamplingParams
from offload.llm.llm import LLM

PROMPTS = [[5, 9, 22, 7, 31, 4, 17, 60, 3, 11], [8, 12, 99]]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _mistral():
    """Mistral: every layer slides (a window of 4, shorter than the text)."""
    config, _ = zoo._configs()["mistral"]
    config = tf.MistralConfig(**{**config.to_dict(), "sliding_window": 4})
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("arch", ["gemma2", "mistral"])
def test_sliding_windows_answer_as_transformers_alone(tmp_path, arch):
    model = zoo.build("gemma2") if arch == "gemma2" else _mistral()
    zoo.save_with_tokenizer(model, tmp_path)
    expected = zoo.greedy_new_tokens(model, PROMPTS, 12)
    for flags in ({}, {"offload_group_size": 1, "offload_prefetch_step": 2, "kv_offload": True}):
        with LLM(tmp_path, max_model_len=64, max_num_batched_tokens=4, **flags) as llm:
            outputs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], PARAMS)
        assert [o.outputs[0].token_ids for o in outputs] == expected
