"""LLM.generate / chat on the real SmolLM2, with and without offloading."""

import re

import pytest
import torch

from offload import ConfigError, SamplingParams
from offload.engine.llm import LLM

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,", "1, 2, 3,"]
GREEDY = SamplingParams(temperature=0, max_tokens=12)
OFFLOADS = {
    "uva": {"cpu_offload_gb": 0.2},
    "uva-copy-per-forward": {"cpu_offload_gb": 0.1, "offload_config_disable_uva": True},
    "prefetch": {"offload_group_size": 1, "offload_prefetch_step": 2},
    "prefetch-4-1": {"offload_group_size": 4, "offload_num_in_group": 1},
    "kv-cache": {"kv_offload": True},
    "uva+kv-cache": {"cpu_offload_gb": 0.2, "swap_space": 0.5},
    "prefetch+kv-cache": {"offload_group_size": 1, "offload_prefetch_step": 2, "swap_space": 1},
}


@pytest.fixture(scope="module")
def resident(smollm2_path):
    return LLM(smollm2_path)


def _llm(path, setting):
    flags = dict(OFFLOADS[setting])
    if flags.pop("offload_config_disable_uva", False):
        return LLM(path, offload_config={**flags, "disable_uva": True})
    return LLM(path, **flags)


def test_chat_answers(resident):
    [out] = resident.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY)
    assert out.outputs[0].text == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop"


def test_unbatched_greedy_matches_transformers_generate(resident):
    ids = resident.tokenizer(PROMPTS[1], return_tensors="pt").input_ids
    with torch.no_grad():
        expected = resident.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False
        )
    [out] = resident.generate(PROMPTS[1], GREEDY)
    assert out.outputs[0].token_ids == expected[0, ids.shape[1] :].tolist()
    assert out.prompt_token_ids == ids[0].tolist() and out.prompt == PROMPTS[1]


@pytest.mark.parametrize("setting", list(OFFLOADS))
def test_offloaded_greedy_is_identical_batched_and_unbatched(smollm2_path, resident, setting):
    llm = _llm(smollm2_path, setting)
    assert llm.offloader.offloaded_bytes > 0 or setting == "kv-cache"
    batched = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in batched] == [
        o.outputs[0].token_ids for o in resident.generate(PROMPTS, GREEDY)
    ]
    alone = llm.generate(PROMPTS[2], GREEDY)
    assert (
        alone[0].outputs[0].token_ids
        == resident.generate(PROMPTS[2], GREEDY)[0].outputs[0].token_ids
    )
    if "kv" in setting:  # the cache went through host memory
        moved = llm.transfer_stats()
        assert moved["kv_bytes_copied"] > 0 and moved["kv_bytes_written_back"] > 0


def test_seeded_sampling_is_reproducible(resident):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=11, max_tokens=10)
    first = [o.outputs[0].token_ids for o in resident.generate(PROMPTS, params)]
    again = [o.outputs[0].token_ids for o in resident.generate(PROMPTS, params)]
    assert first == again
    greedy = [o.outputs[0].token_ids for o in resident.generate(PROMPTS, GREEDY)]
    assert first != [g[:10] for g in greedy]  # it really sampled


def test_stop_strings_max_tokens_and_n(resident):
    [out] = resident.generate(
        "1, 2, 3,", SamplingParams(temperature=0, stop=[", 6"], max_tokens=20)
    )
    assert out.outputs[0].text == " 4, 5" and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == ", 6"
    [out] = resident.generate(
        "1, 2, 3,",
        SamplingParams(temperature=0, stop=[", 6"], max_tokens=20, include_stop_str_in_output=True),
    )
    assert out.outputs[0].text == " 4, 5, 6"
    [out] = resident.generate("1, 2, 3,", SamplingParams(temperature=0, max_tokens=5))
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 5
    [out] = resident.generate("Hello", SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=4))
    assert [c.index for c in out.outputs] == [0, 1, 2] and len(
        {tuple(c.token_ids) for c in out.outputs}
    ) > 1


def test_bad_requests_are_clear_errors(smollm2_path, resident):
    with pytest.raises(ConfigError, match="one SamplingParams or one per prompt"):
        resident.generate(PROMPTS, [GREEDY])
    with pytest.raises(ConfigError, match="must have 1 to"):
        LLM(smollm2_path, max_model_len=8).generate("word " * 20, GREEDY)
    with pytest.raises(ConfigError, match="not both"):
        LLM(smollm2_path, offload_config={"cpu_offload_gb": 1}, cpu_offload_gb=1)
    with pytest.raises(ConfigError, match="max_model_len must be in"):
        LLM(smollm2_path, max_model_len=10**9)


def test_max_model_len_bounds_prompt_plus_output(smollm2_path):
    llm = LLM(smollm2_path, max_model_len=12)
    [out] = llm.generate("1, 2, 3,", SamplingParams(temperature=0, max_tokens=100))
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 12
    assert out.outputs[0].finish_reason == "length"


def test_kv_offload_sampling_is_reproducible(smollm2_path, resident):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=10)
    llm = LLM(smollm2_path, kv_offload=True)
    expected = [o.outputs[0].token_ids for o in resident.generate(PROMPTS, params)]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == expected


def test_kv_host_memory_is_reused_across_calls_and_grows_when_needed(smollm2_path, resident):
    llm = LLM(smollm2_path, kv_offload=True)
    pool = llm._kv_pool
    expected = [o.outputs[0].token_ids for o in resident.generate(PROMPTS, GREEDY)]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    held = [slab.buffer.data_ptr() for slab in pool._slabs]
    size = pool.num_bytes
    # A smaller call (stale rows of the last call are in the buffers) reuses them ...
    [one] = llm.generate(PROMPTS[2], GREEDY)
    assert one.outputs[0].token_ids == expected[2]
    assert [slab.buffer.data_ptr() for slab in pool._slabs] == held and pool.num_bytes == size
    # ... and a larger one grows them.
    longer = SamplingParams(temperature=0, max_tokens=40)
    want = [o.outputs[0].token_ids for o in resident.generate(PROMPTS, longer)]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, longer)] == want
    assert pool.num_bytes > size


def test_swap_space_beyond_ram_is_refused_before_loading(smollm2_path, monkeypatch):
    import offload.engine.llm as llm_module

    def must_not_run(*args, **kwargs):
        raise AssertionError("read the model before refusing swap_space")

    monkeypatch.setattr(llm_module, "build_empty", must_not_run)
    with pytest.raises(ConfigError, match=r"swap_space=100000 GiB is not possible.*RAM available"):
        LLM(smollm2_path, swap_space=100_000)
    with pytest.raises(ConfigError, match="swap_space=-1 GiB is not possible"):
        LLM(smollm2_path, swap_space=-1)
    with pytest.raises(ConfigError, match="swap_space must be a number"):
        LLM(smollm2_path, swap_space="lots")


def test_a_batch_too_big_for_swap_space_is_refused_and_the_engine_still_works(smollm2_path):
    llm = LLM(smollm2_path, swap_space=0.001)  # 1 MiB: 7 positions of 3 sequences
    with pytest.raises(
        ConfigError, match=r"needs 6\.7 MiB of host memory, more than swap_space \(1\.0 MiB\)"
    ):
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40))
    [out] = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=4))
    assert len(out.outputs[0].token_ids) == 4


def test_prompts_as_token_ids_or_dicts(resident):
    ids = resident.tokenizer(PROMPTS[0]).input_ids
    expected = resident.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids
    by_ids, by_dict = resident.generate([{"prompt_token_ids": ids}, {"prompt": PROMPTS[0]}], GREEDY)
    assert by_ids.outputs[0].token_ids == expected and by_ids.prompt_token_ids == ids
    assert by_dict.outputs[0].token_ids == expected and by_dict.prompt == PROMPTS[0]
    with pytest.raises(ConfigError, match="a prompt must be a string"):
        resident.generate([42], GREEDY)


def test_the_load_shows_progress_in_bytes(smollm2_path, capsys):
    LLM(smollm2_path, progress=True)
    bar = capsys.readouterr().err
    assert "Loading weights" in bar and "100%" in bar
    assert re.search(r"100%.*\b(\d+)M/\1M\b", bar)  # bytes (MiB), not tensors
    LLM(smollm2_path, progress=False)
    assert "Loading weights" not in capsys.readouterr().err


def test_swap_space_must_leave_room_for_the_offloaded_weights(smollm2_path, monkeypatch):
    """swap_space alone fits in RAM, but not with the 0.39 GiB of weights offloading puts
    there too: refused before loading (the RAM figure is pinned, so the test is stable)."""
    import offload.engine.kv_cache as kv_module
    import offload.engine.llm as llm_module

    monkeypatch.setattr(kv_module, "available_ram_bytes", lambda: 2 * 2**30)
    monkeypatch.setattr(llm_module, "load_model", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(
        ConfigError, match=r"swap_space=1\.8 GiB plus the 0\.39 GiB of offloaded weights"
    ):
        LLM(smollm2_path, swap_space=1.8, cpu_offload_gb=0.39)
