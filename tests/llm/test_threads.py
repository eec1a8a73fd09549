"""One LLM shared by threads: every output equals the sequential run's."""

import pytest
import zoo
from interrupts import run_in_threads

from offload import SamplingParams
from offload.llm.llm import LLM

SETTINGS = {
    "prefetch+kv": {"offload_group_size": 1, "offload_prefetch_step": 2, "kv_offload": True},
    "kv": {"kv_offload": True},
    "modules+kv": {
        "offload_group_size": 1,
        "offload_prefetch_step": 2,
        "prefetch_unit": "module",
        "kv_offload": True,
    },
}


def _requests(count):
    """Different prompts, lengths and sampling per call, so that mixed-up state shows."""
    requests = []
    for i in range(count):
        prompt = " ".join(f"t{3 + (i * 7 + j * 13) % 120}" for j in range(2 + i % 5))
        params = SamplingParams(
            temperature=0 if i % 2 else 0.8, seed=i, max_tokens=3 + i % 4, ignore_eos=True
        )
        requests.append((prompt, params))
    return requests


def _hammer(llm, requests, num_threads, calls_per_thread):
    """Each thread makes `calls_per_thread` calls, cycling through `requests`."""
    results, errors = {}, []

    def work(thread, stop):
        try:
            for call in range(calls_per_thread):
                if stop.is_set():
                    return
                index = (thread * calls_per_thread + call) % len(requests)
                prompt, params = requests[index]
                out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
                results[(thread, call)] = (index, out.token_ids)
        except BaseException as error:  # reported below, in the test's thread
            errors.append(error)

    run_in_threads(work, num_threads)
    assert not errors, errors
    return results


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_threads_sharing_one_llm_get_the_sequential_outputs(tmp_path, setting):
    # Six layers: the slot ring (two slots) still wraps three times a forward, and every
    # call still offloads weights and the KV cache; more layers only add time.
    llm = LLM(zoo.save_tiny_llm(tmp_path, num_layers=6), **SETTINGS[setting])
    requests = _requests(12)
    reference = [llm.generate([p], s, use_tqdm=False)[0].outputs[0].token_ids for p, s in requests]
    results = _hammer(llm, requests, num_threads=4, calls_per_thread=20)
    assert len(results) == 80
    wrong = [key for key, (index, tokens) in results.items() if tokens != reference[index]]
    assert not wrong, f"{len(wrong)} of {len(results)} outputs differ from the sequential run"
    assert llm.transfer_stats().weight_copied_bytes > 0 or setting == "kv"
    assert llm.transfer_stats().kv_copied_bytes > 0


def test_threads_on_the_default_model_with_prefetch_and_kv_offload(short_path):
    llm = LLM(short_path, **SETTINGS["prefetch+kv"])  # (its first blocks: short_model.py)
    requests = [
        ("The capital of France is", SamplingParams(temperature=0, max_tokens=3)),
        ("1, 2, 3,", SamplingParams(temperature=0.7, seed=5, max_tokens=2)),
    ]
    reference = [llm.generate([p], s, use_tqdm=False)[0].outputs[0].token_ids for p, s in requests]
    results = _hammer(llm, requests, num_threads=2, calls_per_thread=20)
    assert all(tokens == reference[index] for index, tokens in results.values())
