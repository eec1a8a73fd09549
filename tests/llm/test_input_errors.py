"""Every bad input to `LLM`, `generate` and `chat` is one line of ours (an OffloadError
naming the argument), raised before any work: never a foreign exception."""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from junk import JUNK

from offload import LLM, ConfigError, OffloadError, SamplingParams

ONE = SamplingParams(temperature=0, max_tokens=1)
HELLO = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path)


def _one_line_naming(error: pytest.ExceptionInfo, needle: str) -> None:
    message = str(error.value)
    assert isinstance(error.value, OffloadError)
    assert "\n" not in message and needle in message, message


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"max_model_len": 3.5}, "max_model_len must be an integer >= 1"),
        ({"max_model_len": "512"}, "max_model_len must be an integer >= 1"),
        ({"max_model_len": True}, "max_model_len must be an integer >= 1"),
        ({"gpu_memory_utilization": "x"}, "gpu_memory_utilization must be a number in (0, 1]"),
        ({"gpu_memory_utilization": float("nan")}, "gpu_memory_utilization must be"),
        ({"gpu_memory_utilization": float("inf")}, "gpu_memory_utilization must be"),
        ({"device_memory_gb": -1}, "device_memory_gb must be a positive, finite number"),
        ({"device_memory_gb": "a"}, "device_memory_gb must be a positive, finite number"),
        ({"swap_space": float("inf")}, "swap_space must be a number of GiB (finite"),
        ({"swap_space": float("nan")}, "swap_space must be a number of GiB (finite"),
        ({"swap_space": 10**400}, "swap_space must be a number of GiB (finite"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"seed": "a"}, "seed must be an integer"),
        ({"seed": 2**64}, "seed must be an integer"),
        ({"dtype": 5}, "dtype must be auto, float32"),
        ({"dtype": torch.int8}, "dtype must be auto, float32"),
        ({"device": 5}, "device must be 'cpu', 'cuda' or 'cuda:N'"),
        ({"device": "tpu"}, "device must be 'cpu', 'cuda' or 'cuda:N'"),
        ({"device": "cuda:99"}, "device 'cuda:99'"),
        ({"load_format": 5}, "load_format must be one of auto, safetensors, dummy"),
        ({"tokenizer": 5}, "tokenizer must be a model directory"),
        ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1"),
        ({"enforce_eager": "yes"}, "enforce_eager must be True or False"),
        ({"kv_offload": "yes"}, "kv_offload must be True or False"),
        ({"progress": 3}, "progress must be True, False or None"),
        ({"model": 5}, "model must be a model directory"),
        ({"model": ""}, "model must be a model directory"),
        ({"offload_config": {"uva": 5}}, "uva must be a UVAOffloadConfig or a mapping"),
        ({"cpu_offload_gb": 10**400}, "uva.cpu_offload_gb must be a finite number"),
    ],
)
def test_bad_llm_arguments_are_refused_before_anything_loads(
    smollm2_path, monkeypatch, kwargs, needle
):
    import offload.llm.args as llm_args_module
    import offload.llm.loading as loading_module
    import offload.model.spec as spec_module

    for module, step in (
        (spec_module, "build_empty"),
        (llm_args_module, "load_tokenizer"),
        (loading_module, "load_model"),
    ):
        monkeypatch.setattr(module, step, lambda *a, _s=step, **k: pytest.fail(_s))
    kwargs = dict(kwargs)
    model = kwargs.pop("model", smollm2_path)
    with pytest.raises(OffloadError) as info:
        LLM(model, **kwargs)
    _one_line_naming(info, needle)


def _tokens():
    yield "Hi"


@pytest.mark.parametrize(
    ("prompts", "needle"),
    [
        (None, "prompts must be a string"),
        (5, "prompts must be a string"),
        (b"bytes", "prompts must be a string"),
        ([["a"]], "a prompt must be a string, {'prompt': str}"),
        ({"prompt": 5}, "prompt 0 is {'prompt': 5}"),
        ({}, "prompt 0 is {}"),
        (["ok", {"prompt_ids": [1]}], "prompt 1 has 'prompt_ids'"),
        ({"prompt_token_ids": [1], "prompt": 5}, "prompt 0's 'prompt' must be a string"),
        ({"prompt_token_ids": [1e9]}, "prompt_token_ids must be a list of integer token ids"),
        ({"prompt_token_ids": "abc"}, "prompt_token_ids must be a list of integer token ids"),
        ({"prompt_token_ids": [True]}, "prompt_token_ids must be a list of integer token ids"),
        ({"prompt_token_ids": []}, "a prompt has 0 tokens"),
        ({"prompt_token_ids": [10**400]}, "prompt 0 holds a token id the model cannot embed"),
        ({"prompt_token_ids": [49152]}, "token ids in [0, 49152), got 49152"),
        (["ok", "bad \ud800 text"], "prompt 1 is not valid text: surrogates not allowed"),
        ({"prompt": "\udfff"}, "prompt 0 is not valid text"),
    ],
)
def test_bad_prompts_are_one_line_errors(llm, prompts, needle):
    with pytest.raises(OffloadError) as info:
        llm.generate(prompts, ONE)
    _one_line_naming(info, needle)


def test_any_iterable_of_prompts_is_taken(llm):
    """A tuple or a generator of prompts is a batch, as a list is (documented)."""
    expected = llm.generate(["Hi"], ONE)[0].outputs[0].token_ids
    assert llm.generate(("Hi",), ONE)[0].outputs[0].token_ids == expected
    assert llm.generate(_tokens(), ONE)[0].outputs[0].token_ids == expected


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"sampling_params": 5}, "sampling_params must be one SamplingParams or one per prompt"),
        ({"sampling_params": "x"}, "sampling_params must be one SamplingParams"),
        ({"sampling_params": [ONE, ONE]}, "one per prompt (1), got 2"),
        ({"sampling_params": [5]}, "got a list holding a int"),
        ({"use_tqdm": "x"}, "use_tqdm must be True, False or a tqdm-like class"),
    ],
)
def test_bad_generate_options_are_one_line_errors(llm, kwargs, needle):
    kwargs = {"sampling_params": ONE, **kwargs}
    with pytest.raises(OffloadError) as info:
        llm.generate("Hi", **kwargs)
    _one_line_naming(info, needle)


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        (None, "messages must be a conversation"),
        ("hi", "messages must be a conversation"),
        (["hi"], "messages[0] must be a list of {'role', 'content'} dicts"),
        ([{"role": "user"}], "messages[0]['content'] must be a string"),
        ([{"role": 5, "content": "x"}], "messages[0]['role'] must be a string"),
        ([{"content": "x"}], "messages[0]['role'] must be a string"),
        ([HELLO, [{"role": "user", "content": 5}]], "messages[1][0]['content'] must be"),
        ([HELLO, ["x"]], "messages[1][0] must be a dict with 'role' and 'content'"),
        ([[]], "messages[0] is an empty conversation"),
        ([HELLO, [{"role": "user", "content": "a \ud83d b"}]], "conversation 1 is not valid text"),
    ],
)
def test_malformed_messages_are_one_line_errors(llm, messages, needle):
    with pytest.raises(OffloadError) as info:
        llm.chat(messages, ONE)
    _one_line_naming(info, needle)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (
            {"chat_template": "{% for %}"},
            "chat template failed on conversation 0: TemplateSyntaxError: Expected an expression",
        ),
        ({"chat_template": "{{ raise_exception('no') }}"}, "TemplateError: no"),
        ({"chat_template": "{{ nothing.here }}"}, "UndefinedError: 'nothing' is undefined"),
        ({"chat_template": "{{ 1 / 0 }}"}, "ZeroDivisionError"),
        ({"chat_template": "{{ messages[0]['content'] + 1 }}"}, "TypeError"),
        ({"chat_template": 5}, "chat_template must be a Jinja template string"),
        ({"chat_template_kwargs": "x"}, "chat_template_kwargs must be a dict"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs may not set 'messages'"),
        ({"chat_template_kwargs": {1: 2}}, "chat_template_kwargs must be a dict"),
        ({"tools": 5}, "tools must be a list of tool definitions"),
        ({"tools": ["x"]}, "tools must be a list of tool definitions"),
        ({"add_generation_prompt": "x"}, "add_generation_prompt must be True or False"),
        ({"use_tqdm": 2}, "use_tqdm must be True, False"),
    ],
)
def test_bad_templates_and_chat_options_are_one_line_errors(llm, kwargs, needle):
    with pytest.raises(OffloadError) as info:
        llm.chat(HELLO, ONE, **kwargs)
    _one_line_naming(info, needle)


def test_no_token_left_to_pick_is_an_error_and_the_engine_goes_on(llm):
    """Every allowed token banned: torch.multinomial's RuntimeError (sampling) or a
    silent token 0 (greedy) before; now one line naming the settings."""
    word = llm.tokenizer.decode([30])
    for temperature in (0.0, 1.0):
        params = SamplingParams(
            temperature=temperature, max_tokens=2, allowed_token_ids=[30], bad_words=[word]
        )
        with pytest.raises(ConfigError) as info:
            llm.generate(["Hi", "Ho"], [ONE, params])
        _one_line_naming(info, "no token is left to pick for prompt 1: allowed_token_ids")
    assert len(llm.generate("Hi", ONE)[0].outputs[0].token_ids) == 1


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    """A tiny model of 128 token ids whose tokenizer has 256: text can hold ids the
    model cannot embed."""
    import zoo

    path = tmp_path_factory.mktemp("small-vocab")
    zoo.build("llama").save_pretrained(path)
    zoo._word_tokenizer(2 * zoo.VOCAB).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda llm: llm.generate("t5 t200", ONE), "got 200"),
        (lambda llm: llm.generate(["t5", {"prompt": "t7 t130"}], ONE), "prompt 1 holds"),
        (
            lambda llm: llm.chat(
                [{"role": "user", "content": "t9 t250"}],
                ONE,
                chat_template="{{ messages[0]['content'] }}",
            ),
            "got 250",
        ),
        (lambda llm: llm.generate({"prompt_token_ids": [5, 128]}, ONE), "got 128"),
    ],
)
def test_token_ids_beyond_the_models_vocabulary_are_refused_before_any_forward(
    small_vocab_model, call, needle
):
    llm = LLM(small_vocab_model)
    llm.model.register_forward_pre_hook(lambda *a: pytest.fail("a forward ran"))
    with pytest.raises(ConfigError) as info:
        call(llm)
    _one_line_naming(info, "token ids in [0, 128)")
    assert needle in str(info.value)


_PROMPT_DICTS = st.dictionaries(st.sampled_from(["prompt", "prompt_token_ids"]), JUNK, max_size=2)
_PROMPTS = st.one_of(JUNK, _PROMPT_DICTS, st.lists(st.one_of(JUNK, _PROMPT_DICTS), max_size=3))
_MESSAGES = st.one_of(
    JUNK,
    st.lists(st.dictionaries(st.sampled_from(["role", "content"]), JUNK, max_size=2), max_size=2),
)


@pytest.fixture(scope="module")
def zoo_llm(smollm2_path, tmp_path_factory):
    """A tiny Llama with a word tokenizer and SmolLM2's chat template: the checks of the
    inputs are the same whatever the model, and each example costs a tiny forward."""
    import shutil

    import zoo

    path = zoo.save_with_tokenizer(zoo.build("llama"), tmp_path_factory.mktemp("zoo-llm"))
    shutil.copy(smollm2_path / "chat_template.jinja", path / "chat_template.jinja")
    llm = LLM(path)
    assert llm.tokenizer.chat_template  # chat() renders, it is not refused outright
    return llm


@settings(max_examples=200, deadline=None)
@given(prompts=_PROMPTS, messages=_MESSAGES)
def test_junk_prompts_and_messages_answer_or_raise_an_offload_error(zoo_llm, prompts, messages):
    """Whatever is passed: outputs, or one line of ours (one token at most is made)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for call in (
            lambda: zoo_llm.generate(prompts, ONE, use_tqdm=False),
            lambda: zoo_llm.chat(messages, ONE, use_tqdm=False),
        ):
            try:
                call()
            except OffloadError as error:
                assert "\n" not in str(error)
