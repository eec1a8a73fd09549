"""LLM.generate / chat on the real SmolLM2, with and without offloading (the offloaded
forms' bits are checked on its first blocks alone: tests/short_model.py)."""

import re

import pytest
import torch
from forwards import record_forwards

from offload import ConfigError, ModelError, SamplingParams
from offload.engine.step_runner import StepRunner
from offload.llm.llm import LLM

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,", "1, 2, 3,"]
GREEDY = SamplingParams(temperature=0, max_tokens=12)
OFFLOADS = {
    "uva": {"cpu_offload_gb": 0.2},
    "uva-copy-per-forward": {"cpu_offload_gb": 0.1, "offload_config_disable_uva": True},
    "prefetch": {"offload_group_size": 1, "offload_prefetch_step": 2},
    "prefetch-4-1": {"offload_group_size": 4, "offload_num_in_group": 1},
    "prefetch-modules": {
        "offload_group_size": 1,
        "offload_prefetch_step": 2,
        "prefetch_unit": "module",
    },
    "kv-cache": {"kv_offload": True},
    "uva+kv-cache": {"cpu_offload_gb": 0.2, "swap_space": 0.5},
    "prefetch+kv-cache": {"offload_group_size": 1, "offload_prefetch_step": 2, "swap_space": 1},
}


@pytest.fixture(scope="module")
def resident(smollm2_path):
    return LLM(smollm2_path)


@pytest.fixture(scope="module")
def short_resident(short_path):
    return LLM(short_path)


@pytest.fixture(scope="module")
def greedy(short_resident):
    """The resident cut model's greedy tokens for PROMPTS, batched and each prompt alone
    (computed once: the offloaded forms' tests compare with them)."""
    batched = [o.outputs[0].token_ids for o in short_resident.generate(PROMPTS, GREEDY)]
    alone = [short_resident.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
    return batched, alone


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
def test_offloaded_greedy_is_identical_batched_and_unbatched(short_path, greedy, setting):
    llm = _llm(short_path, setting)
    assert llm.offloader.offloaded_bytes > 0 or setting == "kv-cache"
    batched = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in batched] == greedy[0]
    alone = llm.generate(PROMPTS[2], GREEDY)
    assert alone[0].outputs[0].token_ids == greedy[1][2]
    if "kv" in setting:  # the cache went through host memory
        moved = llm.transfer_stats()
        assert moved.kv_copied_bytes > 0 and moved.kv_written_back_bytes > 0


def test_seeded_sampling_is_reproducible(short_resident, greedy):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=11, max_tokens=10)
    first = [o.outputs[0].token_ids for o in short_resident.generate(PROMPTS, params)]
    again = [o.outputs[0].token_ids for o in short_resident.generate(PROMPTS, params)]
    assert first == again
    assert first != [g[:10] for g in greedy[0]]  # it really sampled


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


def test_kv_offload_sampling_is_reproducible(short_path, short_resident):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=10)
    llm = LLM(short_path, kv_offload=True)
    expected = [o.outputs[0].token_ids for o in short_resident.generate(PROMPTS, params)]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == expected


def test_kv_host_memory_is_reused_across_calls_and_grows_when_needed(
    short_path, short_resident, greedy
):
    llm = LLM(short_path, kv_offload=True)
    pool = llm._kv_pool
    expected = greedy[0]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    held = [slab.buffer.data_ptr() for slab in pool._slabs]
    size = pool.num_bytes
    # A smaller call (stale rows of the last call are in the buffers) reuses them ...
    [one] = llm.generate(PROMPTS[2], GREEDY)
    assert one.outputs[0].token_ids == expected[2]
    assert [slab.buffer.data_ptr() for slab in pool._slabs] == held and pool.num_bytes == size
    # ... and a larger one grows them (its prompt past 128 positions).
    longer = [{"prompt_token_ids": list(range(300, 430))}]
    want = [o.outputs[0].token_ids for o in short_resident.generate(longer, GREEDY)]
    assert [o.outputs[0].token_ids for o in llm.generate(longer, GREEDY)] == want
    assert pool.num_bytes > size


def test_swap_space_beyond_ram_is_refused_before_loading(smollm2_path, monkeypatch):
    import offload.model.spec as spec_module

    def must_not_run(*args, **kwargs):
        raise AssertionError("read the model before refusing swap_space")

    monkeypatch.setattr(spec_module, "build_empty", must_not_run)
    with pytest.raises(ConfigError, match=r"swap_space=100000 GiB is not possible.*RAM available"):
        LLM(smollm2_path, swap_space=100_000)
    with pytest.raises(ConfigError, match="swap_space=-1 GiB is not possible"):
        LLM(smollm2_path, swap_space=-1)
    with pytest.raises(ConfigError, match="swap_space must be a number"):
        LLM(smollm2_path, swap_space="lots")


def test_a_batch_too_big_for_swap_space_is_refused_and_the_engine_still_works(smollm2_path):
    llm = LLM(smollm2_path, swap_space=0.001)  # 1 MiB: 7 positions of 3 sequences
    with pytest.raises(  # (one row of 51 positions)
        ConfigError, match=r"needs 2\.2 MiB of host memory, more than swap_space \(1\.0 MiB\)"
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
    import offload.llm.fit as fit_module
    import offload.llm.loading as loading_module

    monkeypatch.setattr(fit_module, "available_ram_bytes", lambda: 2 * 2**30)
    monkeypatch.setattr(loading_module, "load_model", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(
        ConfigError, match=r"swap_space=1\.8 GiB plus the 0\.39 GiB of offloaded weights"
    ):
        LLM(smollm2_path, swap_space=1.8, cpu_offload_gb=0.39)


def _copy_of(path, tmp_path, drop=(), **generation):
    """The model folder, linked file by file, without `drop` and with a changed
    generation_config.json."""
    import json

    for item in path.iterdir():
        if item.name not in drop and item.name != "generation_config.json":
            (tmp_path / item.name).symlink_to(item)
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def test_each_row_may_use_max_model_len_whatever_else_is_batched(short_path):
    llm = LLM(short_path, max_model_len=40)
    short, long = [5, 6, 7], list(range(100, 130))  # 3 and 30 tokens
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    [alone] = llm.generate({"prompt_token_ids": short}, params)
    batched = llm.generate([{"prompt_token_ids": short}, {"prompt_token_ids": long}], params)
    assert len(alone.outputs[0].token_ids) == 20
    assert batched[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert len(batched[1].outputs[0].token_ids) == 10  # 30 + 10 = max_model_len
    assert batched[1].outputs[0].finish_reason == "length"


def test_end_ids_of_generation_config_stop_and_end_token_ids(smollm2_path, resident, tmp_path):
    [free] = resident.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8))
    end = free.outputs[0].token_ids[2]
    first = free.outputs[0].token_ids.index(end)
    llm = LLM(_copy_of(smollm2_path, tmp_path, eos_token_id=[2, end]))
    [out] = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8))
    completion = out.outputs[0]
    # As vLLM: the end token is the last of token_ids, the text stops before it.
    assert completion.token_ids == free.outputs[0].token_ids[: first + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason is None
    assert completion.text == llm.tokenizer.decode(completion.token_ids[:-1])


def test_a_stop_token_id_ends_token_ids_and_names_the_stop(resident):
    [free] = resident.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8))
    stop = free.outputs[0].token_ids[3]
    first = free.outputs[0].token_ids.index(stop)
    [out] = resident.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop])
    )
    assert out.outputs[0].token_ids == free.outputs[0].token_ids[: first + 1]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop)


def test_empty_requests_and_out_of_range_ids(resident):
    assert resident.generate([]) == [] and resident.chat([]) == []
    vocab = resident.model.config.vocab_size
    with pytest.raises(ConfigError, match=rf"token ids in \[0, {vocab}\), got {vocab}"):
        resident.generate({"prompt_token_ids": [1, vocab]})
    with pytest.raises(ConfigError, match="got -1"):
        resident.generate({"prompt_token_ids": [-1]})
    for bad in ([1.5], ["12"], 7):
        with pytest.raises(ConfigError, match="list of integer token ids"):
            resident.generate({"prompt_token_ids": bad})
    numpy_ids = torch.tensor([1, 2, 3]).numpy()  # numpy integers are ids too, as in vLLM
    [out] = resident.generate({"prompt_token_ids": list(numpy_ids)}, SamplingParams(max_tokens=1))
    assert out.prompt_token_ids == [1, 2, 3]
    with pytest.raises(ConfigError, match="stop_token_ids must hold token ids below"):
        resident.generate("Hi", SamplingParams(stop_token_ids=[vocab], min_tokens=1))
    for field in ("logit_bias", "allowed_token_ids"):
        bad = {vocab: 1.0} if field == "logit_bias" else [1, vocab]
        needle = f"{field} must hold token ids below the vocabulary size {vocab}, got {vocab}"
        with pytest.raises(ConfigError, match=needle):
            resident.generate(["Hi", "Ho"], [GREEDY, SamplingParams(**{field: bad})])


def test_repetition_penalty_greedy_matches_transformers_generate(resident):
    ids = resident.tokenizer(PROMPTS[2], return_tensors="pt").input_ids
    with torch.no_grad():
        expected = resident.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=16,
            do_sample=False,
            repetition_penalty=1.3,
        )
    penalised = SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3)
    [out] = resident.generate(PROMPTS[2], penalised)
    assert out.outputs[0].token_ids == expected[0, ids.shape[1] :].tolist()
    [plain] = resident.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=16))
    assert plain.outputs[0].token_ids != out.outputs[0].token_ids  # the penalty did something


PENALISED = SamplingParams(
    temperature=0, max_tokens=12, presence_penalty=0.8, frequency_penalty=0.6, logprobs=3
)


def _tokens_and_logprobs(outputs):
    return [
        (c.token_ids, [{t: e.logprob for t, e in entry.items()} for entry in c.logprobs or []])
        for c in (o.outputs[0] for o in outputs)
    ]


MIXED = [GREEDY, PENALISED, SamplingParams(temperature=0, max_tokens=12, logprobs=0)]


@pytest.fixture(scope="module")
def penalised(short_resident):
    """The resident cut model's tokens and log-probabilities for PROMPTS with MIXED params,
    checked once: the penalised row's are those of the row alone."""
    resident = short_resident
    expected = _tokens_and_logprobs(resident.generate(PROMPTS, MIXED))
    alone = _tokens_and_logprobs(resident.generate(PROMPTS[1], PENALISED))
    # The other rows' tokens are not counted against it (the log-probabilities differ in
    # the last bits between a padded batch and a lone row, as without penalties).
    assert expected[1][0] == alone[0][0]
    for batched, single in zip(expected[1][1], alone[0][1], strict=True):
        assert list(batched) == list(single)
        assert list(batched.values()) == pytest.approx(list(single.values()), abs=1e-4)
    plain = resident.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12))
    assert plain[0].outputs[0].token_ids != alone[0][0]
    return expected


@pytest.mark.parametrize("setting", ["prefetch", "uva+kv-cache"])
def test_penalties_and_logprobs_are_per_row_and_unchanged_by_offloading(
    short_path, penalised, setting
):
    mixed, expected = MIXED, penalised
    llm = _llm(short_path, setting)
    assert _tokens_and_logprobs(llm.generate(PROMPTS, mixed)) == expected  # bit for bit
    assert llm.offloader.stats().bytes_copied > 0 or setting != "prefetch"


def test_logprobs_are_those_of_a_plain_forward(resident):
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, prompt_logprobs=2)
    [out] = resident.generate(PROMPTS[0], params)
    completion = out.outputs[0]
    ids = out.prompt_token_ids + completion.token_ids
    with torch.no_grad():
        reference = torch.log_softmax(resident.model(torch.tensor([ids])).logits[0].float(), -1)
    width = len(out.prompt_token_ids)
    assert len(completion.logprobs) == len(completion.token_ids)
    for step, (token, entry) in enumerate(
        zip(completion.token_ids, completion.logprobs, strict=True)
    ):
        expected = reference[width - 1 + step]
        assert next(iter(entry)) == token and entry[token].rank == 1  # greedy: the most likely
        assert len(entry) == 3  # the chosen token is in the top 3
        assert [t for t in entry] == expected.topk(3).indices.tolist()
        for t, logprob in entry.items():
            assert logprob.logprob == pytest.approx(expected[t].item(), abs=1e-4)
            assert logprob.decoded_token == resident.tokenizer.decode([t])
    total = sum(
        e[t].logprob for e, t in zip(completion.logprobs, completion.token_ids, strict=True)
    )
    assert completion.cumulative_logprob == pytest.approx(total)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == width
    for place, (token, entry) in enumerate(
        zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True)
    ):
        assert next(iter(entry)) == token and len(entry) in (2, 3)
        assert entry[token].logprob == pytest.approx(reference[place, token].item(), abs=1e-4)
        assert entry[token].rank == int((reference[place] >= reference[place, token]).sum())
    [plain] = resident.generate(PROMPTS[0], GREEDY)
    assert plain.prompt_logprobs is None and plain.outputs[0].logprobs is None
    assert plain.outputs[0].cumulative_logprob is None
    with pytest.raises(ConfigError, match="at most max_logprobs=20"):
        resident.generate("Hi", SamplingParams(logprobs=21))
    with pytest.raises(ConfigError, match="prompt_logprobs=-1 asks for"):
        resident.generate("Hi", SamplingParams(prompt_logprobs=-1))


def test_bad_words_are_never_generated(resident):
    def text(prompt, **kwargs):
        params = SamplingParams(temperature=0, max_tokens=12, **kwargs)
        return resident.generate(prompt, params, use_tqdm=False)[0].outputs[0].text

    assert text(PROMPTS[0]).startswith(" Paris")
    assert "Paris" not in text(PROMPTS[0], bad_words=["Paris"])
    # A word of several tokens: only its last token is banned, only after the others.
    assert text(PROMPTS[2]).startswith(" 4, 5, 6, 7")
    assert text(PROMPTS[2], bad_words=["5, 6"]).startswith(" 4, 5, 7")


def test_truncate_prompt_tokens_keeps_the_last_tokens(smollm2_path, resident):
    params = SamplingParams(temperature=0, max_tokens=6, truncate_prompt_tokens=4)
    [cut] = resident.generate(PROMPTS[1], params)
    ids = resident.tokenizer(PROMPTS[1]).input_ids
    assert cut.prompt_token_ids == ids[-4:] and cut.prompt == PROMPTS[1]
    [same] = resident.generate(
        {"prompt_token_ids": ids[-4:]}, SamplingParams(temperature=0, max_tokens=6)
    )
    assert cut.outputs[0].token_ids == same.outputs[0].token_ids
    small = LLM(smollm2_path, max_model_len=8)
    with pytest.raises(ConfigError, match="must have 1 to 7"):
        small.generate(PROMPTS[1], GREEDY)
    [fitted] = small.generate(PROMPTS[1], SamplingParams(max_tokens=4, truncate_prompt_tokens=-1))
    assert fitted.prompt_token_ids == ids[-7:] and len(fitted.outputs[0].token_ids) == 1


def test_use_tqdm_counts_processed_prompts(resident):
    bars = []

    class Recorder:
        def __init__(self, total, **kwargs):
            self.total, self.n, self.closed = total, 0, False
            bars.append(self)

        def update(self, count):
            assert count >= 0
            self.n += count

        def close(self):
            self.closed = True

    params = [SamplingParams(temperature=0, max_tokens=n) for n in (2, 5, 9)]
    resident.generate(PROMPTS, params, use_tqdm=Recorder)
    [bar] = bars
    assert (bar.total, bar.n, bar.closed) == (3, 3, True)
    resident.generate(PROMPTS, params, use_tqdm=False)
    assert len(bars) == 1


def test_chat_takes_vllms_template_arguments(resident):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ suffix }}"
    [out] = resident.chat(
        messages,
        GREEDY,
        chat_template=template,
        chat_template_kwargs={"suffix": " Answer: The capital of France is"},
    )
    assert out.prompt == "What is the capital of France? Answer: The capital of France is"
    assert out.outputs[0].text.startswith(" Paris")
    start = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The capital"}]
    [cont] = resident.chat(start, GREEDY, add_generation_prompt=False, continue_final_message=True)
    assert cont.prompt.rstrip().endswith("The capital")
    with pytest.raises(ConfigError, match="continue_final_message=True needs"):
        resident.chat(start, GREEDY, continue_final_message=True)


def test_a_model_without_tokenizer_is_refused_before_its_weights_load(
    smollm2_path, tmp_path, monkeypatch
):
    import offload.llm.loading as loading_module

    def must_not_run(*args, **kwargs):
        raise AssertionError("loaded the weights before finding the tokenizer missing")

    monkeypatch.setattr(loading_module, "load_model", must_not_run)
    folder = _copy_of(smollm2_path, tmp_path, drop=("tokenizer.json", "tokenizer_config.json"))
    with pytest.raises(ModelError, match="has no usable tokenizer"):
        LLM(folder)


def test_tokenizer_may_come_from_another_folder(smollm2_path, tmp_path, resident):
    folder = _copy_of(smollm2_path, tmp_path, drop=("tokenizer.json", "tokenizer_config.json"))
    llm = LLM(folder, tokenizer=smollm2_path)
    [out] = llm.generate(PROMPTS[0], GREEDY)
    assert out.outputs[0].token_ids == resident.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids


def test_max_num_seqs_splits_the_batch(short_path, short_resident, monkeypatch):
    llm = LLM(short_path, max_num_seqs=2, cpu_offload_gb=0.1)
    sizes = _decode_sizes(monkeypatch)
    params = [GREEDY, SamplingParams(temperature=0, max_tokens=5, n=2), GREEDY]
    got = llm.generate(PROMPTS, params)
    assert max(sizes) == 2 and sizes.count(2) > 1  # four sequences, two at a time
    expected = short_resident.generate(PROMPTS, params)
    assert [[c.token_ids for c in o.outputs] for o in got] == [
        [c.token_ids for c in o.outputs] for o in expected
    ]


def test_a_mixture_of_experts_checkpoint_generates_as_transformers_does(tmp_path):
    """A per-expert MoE checkpoint (the hub's layout), offloaded layer by layer with its
    KV cache in host memory, gives transformers' own greedy tokens."""
    import zoo

    model = zoo.build("qwen3_moe", num_layers=3)
    zoo.save_with_tokenizer(model, tmp_path)
    ids = [5, 17, 42, 9, 77]
    expected = zoo.greedy(model, torch.tensor([ids]), 8)[0, len(ids) :].tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for flags in ({}, {"offload_group_size": 1, "offload_prefetch_step": 2, "kv_offload": True}):
        llm = LLM(tmp_path, **flags)
        [out] = llm.generate({"prompt_token_ids": ids}, params)
        assert out.outputs[0].token_ids == expected, flags
    assert llm.offloader.stats().bytes_copied > 0
    assert llm.transfer_stats().kv_copied_bytes > 0


def test_chat_needs_a_chat_template(smollm2_path, tmp_path):
    llm = LLM(_copy_of(smollm2_path, tmp_path, drop=("chat_template.jinja",), eos_token_id=2))
    with pytest.raises(ConfigError, match="no chat template"):
        llm.chat([{"role": "user", "content": "Hi"}])


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"device": "nonsense"}, "device must be 'cpu', 'cuda' or 'cuda:N'"),
        ({"device": "meta"}, "device must be 'cpu', 'cuda' or 'cuda:N'"),
        ({"device_memory_gb": float("nan")}, "device_memory_gb must be a positive, finite"),
        ({"device_memory_gb": float("inf")}, "device_memory_gb must be a positive, finite"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size must be 1"),
        ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1, got 0"),
        ({"max_logprobs": -2}, "max_logprobs must be an integer >= -1, got -2"),
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size must be an integer >= 1"),
        ({"trust_remote_code": "yes"}, "trust_remote_code must be True or False, got 'yes'"),
    ],
)
def test_bad_device_settings_are_one_line_errors(smollm2_path, kwargs, needle):
    with pytest.raises(ConfigError) as info:
        LLM(smollm2_path, **kwargs)
    assert needle in str(info.value) and "\n" not in str(info.value)


def _decode_sizes(monkeypatch) -> list[int]:
    """Records the rows of every decode step of the engine core."""
    sizes, decode = [], StepRunner.decode
    monkeypatch.setattr(
        StepRunner, "decode", lambda runner, rows: decode(runner, sizes.append(len(rows)) or rows)
    )
    return sizes


def test_chunked_prefill_is_unchanged_by_offloading_and_keeps_the_tokens(
    short_path, greedy, monkeypatch
):
    chunked = LLM(short_path, max_num_batched_tokens=9)
    offloaded = LLM(
        short_path, max_num_batched_tokens=9, offload_group_size=1, offload_prefetch_step=2,
        swap_space=0.5,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=2, logprobs=2)
    expected = chunked.generate(PROMPTS, params)
    events = record_forwards(monkeypatch)
    before = offloaded.transfer_stats()
    got = offloaded.generate(PROMPTS, params)
    after = offloaded.transfer_stats()
    # Each prompt prefills alone or rides in a decode step, 9 columns a chunk, in order.
    lengths = [len(o.prompt_token_ids) for o in got]
    chunks = [c for n in lengths for c in [9] * (n // 9) + ([n % 9] if n % 9 else [])]
    assert [e[-1] for e in events if e[0] in ("prefill", "mixed")] == chunks
    # Once the first prompt's rows decode, the next prompts' chunks share their steps.
    assert any(e[0] == "mixed" for e in events) and ("apart",) not in events
    # Each forward (plus, at the first call, the one that probes the KV shapes) brings in
    # every offloaded layer once (4 layers over 2 slots).
    forwards = after.num_forwards - before.num_forwards
    assert forwards == 1 + len(events)
    copied = after.weight_copied_bytes - before.weight_copied_bytes
    assert copied == forwards * offloaded.offloader.offloaded_bytes
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert mine.outputs[0].logprobs == theirs.outputs[0].logprobs
        assert mine.prompt_logprobs == theirs.prompt_logprobs


def test_chunked_prefill_makes_a_long_context_fit(smollm2_path):
    """A 0.25 GiB device holds the resident embeddings and two KV slots, but not the
    activations of an 8192-token prefill: chunks of 256 tokens fit."""
    flags = dict(device_memory_gb=0.25, kv_offload=True, cpu_offload_gb="auto")
    with pytest.raises(ModelError, match="max_num_batched_tokens"):
        LLM(smollm2_path, **flags)
    llm = LLM(smollm2_path, max_num_batched_tokens=256, **flags)
    assert llm.max_model_len == 8192
    assert llm.memory_needs.activations < 0.02 * 2**30
    [out] = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY)
    assert out.outputs[0].text == "The capital of France is Paris."
    with pytest.raises(ConfigError, match="max_num_batched_tokens must be an integer >= 1"):
        LLM(smollm2_path, max_num_batched_tokens=0)


def test_alibi_attention_bloom_generates_as_transformers_does_offloaded_or_not(tmp_path):
    """Bloom builds its ALiBi bias from the 2D attention mask, which must then cover the
    whole static cache, in the prefill as in decode."""
    import zoo

    model = zoo.build("bloom")
    zoo.save_with_tokenizer(model, tmp_path)
    prompts = [[5, 9, 22, 7, 31, 4, 17, 60, 3, 11], [8, 12, 99]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = zoo.greedy_new_tokens(model, prompts, 8)
    for flags in ({}, {"offload_group_size": 1, "offload_prefetch_step": 2, "kv_offload": True}):
        llm = LLM(tmp_path, max_model_len=64, max_num_batched_tokens=8, **flags)
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
        assert [o.outputs[0].token_ids for o in outputs] == expected
