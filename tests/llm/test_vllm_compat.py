"""vLLM habits that must work unchanged: the device chosen for the user, `max_tokens=None`,
`get_tokenizer()`, and vLLM's `LLM` arguments that do not apply here."""

from __future__ import annotations

import pytest
import torch
import zoo

from offload import LLM, SamplingParams
from offload.errors import ConfigError
from offload.llm.vllm_args import IGNORED
from offload.memory import device as devices


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return zoo.save_tiny_llm(tmp_path_factory.mktemp("tiny"), num_layers=2)


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, max_model_len=24, offload_group_size=1, offload_num_in_group=1)


def test_auto_device_is_a_usable_gpu_else_the_cpu(monkeypatch):
    monkeypatch.setattr(devices, "cuda_usable", lambda: False)
    assert devices.check_device("auto") == torch.device("cpu")
    monkeypatch.setattr(devices, "cuda_usable", lambda: True)
    assert devices.check_device("auto") == torch.device("cuda", 0)


def test_llm_runs_on_the_auto_device_by_default(llm):
    expected = torch.device("cuda", 0) if devices.cuda_usable() else torch.device("cpu")
    assert llm.device == expected
    assert next(llm.model.parameters()).device.type == expected.type


def test_max_tokens_none_generates_until_max_model_len(llm):
    params = SamplingParams(max_tokens=None, ignore_eos=True, temperature=0)
    prompt = [3, 4, 5, 6]
    (output,) = llm.generate({"prompt_token_ids": prompt}, params)
    assert len(prompt) + len(output.outputs[0].token_ids) == llm.max_model_len
    assert output.outputs[0].finish_reason == "length"
    # min_tokens has no upper bound then, but must still be a whole number >= 0.
    assert SamplingParams(max_tokens=None, min_tokens=1000).min_tokens == 1000
    with pytest.raises(ConfigError, match="max_tokens must be an integer >= 1"):
        SamplingParams(max_tokens=0)


def test_get_tokenizer_is_the_tokenizer_in_use(llm):
    tokenizer = llm.get_tokenizer()
    assert tokenizer is llm.tokenizer
    assert (
        tokenizer("a b").input_ids
        == llm.generate("a b", SamplingParams(max_tokens=1))[0].prompt_token_ids
    )


def test_vllm_arguments_that_change_nothing_are_accepted(tiny, llm):
    vllm_style = LLM(
        tiny,
        max_model_len=24,
        trust_remote_code=False,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        quantization=None,
        kv_cache_dtype="auto",
        enforce_eager=True,
        block_size=16,
        disable_log_stats=True,
        tokenizer_mode="auto",
        offload_group_size=1,
        offload_num_in_group=1,
    )
    params = SamplingParams(max_tokens=6, temperature=0)
    expected = llm.generate("a b c", params)[0].outputs[0].token_ids
    assert vllm_style.generate("a b c", params)[0].outputs[0].token_ids == expected


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("quantization", "bitsandbytes"),
        ("kv_cache_dtype", "fp8"),
        ("enable_lora", True),
        ("data_parallel_size", 2),
        ("revision", "v2"),
        ("block_size", 0),
        ("hf_overrides", {"num_hidden_layers": 1}),
    ],
)
def test_vllm_arguments_that_would_change_something_are_refused_by_name(tiny, name, value):
    with pytest.raises(ConfigError, match=rf"^LLM\(\): {name}=.* is not supported \(") as error:
        LLM(tiny, **{name: value})
    assert "\n" not in str(error.value)


def test_an_unknown_argument_lists_what_is_accepted(tiny):
    with pytest.raises(ConfigError) as error:
        LLM(tiny, max_num_sequences=4)
    message = str(error.value)
    assert "unexpected argument 'max_num_sequences'" in message
    for accepted in ("max_num_seqs", "swap_space", "cpu_offload_gb", "offload_prefetch_step"):
        assert accepted in message
    assert all(name in message for name in IGNORED)
