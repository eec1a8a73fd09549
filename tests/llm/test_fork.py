"""A process forked after a model was loaded gets one clear error at its first call,
never a hang: the threads the model waits on (copies, reads, torch's workers) stay in
the parent."""

import gc
import os
import select

import pytest
import torch
import zoo

import offload
from offload import SamplingParams
from offload.llm.llm import LLM

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def _in_a_fork(call) -> str:
    """What `call()` did in a forked child: "ok", or the error's type and message; a
    child that does not answer within 60 s is killed, and that is a failure."""
    # (the LLMs of earlier tests in this worker, in reference cycles, freed first: their
    # rows reserve address space, and past the RAM a heuristic overcommit refuses a fork)
    gc.collect()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, and leave without running any cleanup
        os.close(read)
        try:
            call()
            answer = "ok"
        except BaseException as error:  # reported to the parent
            answer = f"{type(error).__name__}: {error}"
        os.write(write, answer.encode()[:4000])
        os._exit(0)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], 60)
        if not ready:
            os.kill(pid, 9)
            pytest.fail("the forked child hung")
        return os.read(read, 4096).decode()
    finally:
        os.close(read)
        os.waitpid(pid, 0)


@pytest.mark.parametrize(
    "flags",
    [
        {"offload_group_size": 1, "offload_prefetch_step": 2, "kv_offload": True},
        {"cpu_offload_gb": 0.0001},
    ],
    ids=["prefetch+kv", "uva"],
)
def test_an_llm_used_in_a_fork_is_one_clear_error(tmp_path, flags):
    llm = LLM(zoo.save_tiny_llm(tmp_path, num_layers=4), **flags)
    expected = llm.generate(["t3 t4"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    answer = _in_a_fork(lambda: llm.generate(["t3 t4"], GREEDY, use_tqdm=False))
    assert answer.startswith("OffloadError: this LLM was loaded by process"), answer
    assert "fork" in answer and "spawn" in answer
    # The parent goes on as before.
    assert llm.generate(["t3 t4"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
    llm.close()


def test_an_offloaded_model_used_in_a_fork_is_one_clear_error():
    model = zoo.build("llama")
    ids = zoo.inputs()
    expected = zoo.logits(model, ids)
    offloader = offload.apply(model, {"offload_group_size": 1, "offload_prefetch_step": 2})
    assert torch.equal(zoo.logits(model, ids), expected)
    answer = _in_a_fork(lambda: zoo.logits(model, ids))
    assert answer.startswith("OffloadError: this offloaded model was loaded by process"), answer
    assert torch.equal(zoo.logits(model, ids), expected)
    offloader.close()


def test_closing_an_llm_in_a_fork_does_not_hang(tmp_path):
    llm = LLM(zoo.save_tiny_llm(tmp_path, num_layers=4), cpu_memory_gb=0, kv_offload=True)
    llm.generate(["t3 t4"], GREEDY, use_tqdm=False)
    assert _in_a_fork(llm.close) == "ok"
    assert llm.generate(["t3 t4"], GREEDY, use_tqdm=False)  # the parent's is still open
    llm.close()
