"""Pipeline parallel on this CPU over gloo: the ranks are separate processes on loopback
(started by the `LLM`, as a user's `pipeline_parallel_size=2` starts them), each loading
only its stage. Tokens and logprobs equal one process's bit for bit — greedy and seeded
sampling, float32 and the default model as stored, with disk-tier stages, through
`generate`, the serving core and speculative decoding — and the hidden states and logits
really travel between the processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest
import zoo

from offload import LLM, SamplingParams
from offload.distributed.channel import Channel, PipelineError
from offload.distributed.cut import NoHead
from offload.distributed.pipeline import PipelinedRunner

PROMPTS = [
    {"prompt_token_ids": [1, 5, 9, 14, 3]},
    {"prompt_token_ids": [2, 7, 7, 100, 20, 30, 4, 8, 8]},
    {"prompt_token_ids": [3, 3, 3]},
]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
SAMPLED = SamplingParams(temperature=0.9, seed=7, max_tokens=10, ignore_eos=True, logprobs=1, n=2)


@pytest.fixture(scope="module")
def attentive(tmp_path_factory):
    return str(zoo.save_attentive_llm(tmp_path_factory.mktemp("pp") / "m", num_layers=6))


def _answers(llm, prompts=PROMPTS):
    outputs = []
    for params in (GREEDY, SAMPLED):
        for out in llm.generate(prompts, params, use_tqdm=False):
            outputs.append(
                [(c.token_ids, [dict(p) for p in c.logprobs], c.text) for c in out.outputs]
            )
    return outputs


def _streamed(llm):
    [*_, last] = llm.stream(PROMPTS[1], GREEDY)
    return last.outputs[0].token_ids, [dict(p) for p in last.outputs[0].logprobs]


@pytest.mark.parametrize("size", [2, 3])
def test_ranks_give_one_process_s_tokens_and_logprobs(attentive, size, monkeypatch):
    kwargs = dict(device="cpu", enforce_eager=True, dtype="float32")
    packed, prefill_packed = [], PipelinedRunner.prefill_packed
    monkeypatch.setattr(
        PipelinedRunner,
        "prefill_packed",
        lambda self, chunks: (packed.append(len(chunks)), prefill_packed(self, chunks))[1],
    )
    with LLM(attentive, **kwargs) as llm:
        expected, streamed = _answers(llm), _streamed(llm)
    # (3 ranks: with the KV cache in host memory, each rank its layers')
    kv = {"kv_offload": True} if size == 3 else {}
    with LLM(attentive, pipeline_parallel_size=size, **kwargs, **kv) as llm:
        channel = llm._pipeline.member.channel
        _holds_its_stage_alone(llm, attentive, size)
        assert _answers(llm) == expected
        assert _streamed(llm) == streamed  # (the serving core: `LLM.serving`)
        assert max(packed) == len(PROMPTS)  # (the prompts in one forward on every stage)
        assert channel.sent_bytes[Channel.HIDDEN] > 0
        assert channel.received_bytes[Channel.LOGITS] > 0
        assert (llm.transfer_stats().kv_copied_bytes > 0) == bool(kv)
        children = llm._pipeline.member.children
    assert all(child.poll() is not None for child in children)  # (closed: the ranks ended)
    assert [child.returncode for child in children] == [0] * (size - 1)


def _holds_its_stage_alone(llm, path, size: int) -> None:
    """Rank 0 built and loaded its layers and the embedding alone: no weight of the other
    layers or of the head is in its process."""
    held = {name: p.numel() for name, p in llm.model.named_parameters()}
    layers = {name.split(".")[2] for name in held if ".layers." in name}
    assert layers == {str(i) for i in range(6 // size)}
    assert "model.embed_tokens.weight" in held and "lm_head.weight" not in held
    assert isinstance(llm.model.get_output_embeddings(), NoHead)
    whole = zoo.load_on_cpu(path)
    layer = sum(p.numel() for p in whole.model.layers[0].parameters())
    outside = whole.model.embed_tokens.weight.numel() + whole.model.norm.weight.numel()
    assert sum(held.values()) == 6 // size * layer + outside


def test_the_default_model_as_stored_on_disk_tier_stages(tmp_path):
    """The shipped model as stored (its Q4_1 blocks), each of two stages streamed from disk
    (cpu_memory_gb=0, read with O_DIRECT): one process's resident bits, and the
    greeting's answer."""
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=1)
    with LLM(device="cpu", enforce_eager=True, enable_prefix_caching=False) as llm:
        [expected] = llm.chat(chat, params, use_tqdm=False)
    with LLM(
        device="cpu", enforce_eager=True, enable_prefix_caching=False,
        pipeline_parallel_size=2, cpu_memory_gb=0, disk_io="direct",
    ) as llm:  # fmt: skip
        [got] = llm.chat(chat, params, use_tqdm=False)
        assert llm.transfer_stats().disk_read_bytes > 0  # (rank 0's stage streamed)
    assert got.outputs[0].text == "The capital of France is Paris."
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert got.outputs[0].logprobs == expected.outputs[0].logprobs


def test_speculative_decoding_over_the_pipeline(attentive):
    """A verify forward (n-gram guesses, k chosen by the engine) runs over the ranks as a
    decode step does: one process's greedy tokens and logprobs."""
    kwargs = dict(device="cpu", enforce_eager=True, dtype="float32")
    prompts = [{"prompt_token_ids": [4, 5, 6, 4, 5, 6, 4, 5, 6, 4, 5]}]
    with LLM(attentive, **kwargs) as llm:
        expected = llm.generate(prompts, GREEDY, use_tqdm=False)[0].outputs[0]
    spec = {"method": "ngram", "prompt_lookup_max": 3}
    with LLM(attentive, pipeline_parallel_size=2, speculative_config=spec, **kwargs) as llm:
        got = llm.generate(prompts, GREEDY, use_tqdm=False)[0].outputs[0]
        assert llm.transfer_stats().num_spec_verifies > 0
        # (a second pipeline in this process while this one lives: one line, at once)
        with pytest.raises(PipelineError, match="this process is in a pipeline already"):
            LLM(attentive, pipeline_parallel_size=2, **kwargs)
    assert (got.token_ids, got.logprobs) == (expected.token_ids, expected.logprobs)


def test_a_rank_killed_mid_request_is_one_error_naming_it(attentive):
    """Rank 1 killed while rank 0 waits on it: the call fails within seconds with an error
    naming rank 1, later calls at once."""
    llm = LLM(attentive, device="cpu", enforce_eager=True, pipeline_parallel_size=2)
    children = llm._pipeline.member.children
    errors: list[BaseException] = []
    long = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)

    def generate():
        try:
            llm.generate([{"prompt_token_ids": [1, 2]}] * 2, long, use_tqdm=False)
        except BaseException as error:  # (the test looks at it)
            errors.append(error)

    thread = threading.Thread(target=generate)
    thread.start()
    time.sleep(1.0)
    killed = time.monotonic()
    os.kill(children[0].pid, signal.SIGKILL)
    thread.join(timeout=30)
    assert not thread.is_alive() and time.monotonic() - killed < 30
    [error] = errors
    assert isinstance(error, PipelineError) and str(error) == "pipeline rank 1 stopped"
    with pytest.raises(PipelineError, match=r"^pipeline rank 1 stopped; close this LLM"):
        llm.generate("a b", GREEDY, use_tqdm=False)
    llm.close()


@pytest.mark.parametrize(
    ("kwargs", "env", "message"),
    [
        ({"pipeline_parallel_size": 7}, {}, "must be between 1 and the model's 6 decoder layers"),
        (
            {"pipeline_parallel_size": 2},
            {"WORLD_SIZE": "3", "RANK": "0"},
            "the launcher started 3 processes but pipeline_parallel_size is 2",
        ),
    ],
)
def test_a_pipeline_that_cannot_be_is_one_line(attentive, monkeypatch, kwargs, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(Exception, match=message) as info:
        LLM(attentive, device="cpu", enforce_eager=True, **kwargs)
    assert "\n" not in str(info.value)


def _offload(*argv, launcher=()):
    command = [*launcher, sys.executable, "-m", "offload.cli", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("launched", [False, True], ids=["ranks started here", "torchrun"])
def test_the_command_answers_over_two_ranks(launched):
    """`offload generate --pipeline-parallel-size 2` answers the greeting; so does every
    rank started by torchrun running the same command (rank 1 serves its stage and ends
    when rank 0 is done), and each ends with status 0 and nothing on stderr but figures."""
    launcher = ()
    if launched:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        launcher = (*torchrun, "--master-port", str(_free_port()), "--no-python")
    done = _offload(
        "generate", "--pipeline-parallel-size", "2", "--enforce-eager", launcher=launcher
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("The capital of France is Paris.")
    assert "pipeline rank" not in done.stderr and "Traceback" not in done.stderr


def test_a_bad_size_from_the_command_is_one_line():
    done = _offload("generate", "--pipeline-parallel-size", "0")
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        "offload: error: pipeline_parallel_size must be an integer >= 1 (ranks, each holding "
        "a stage of the decoder layers), got 0"
    ]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_server_over_two_ranks_answers_and_exits_when_a_rank_is_lost(tmp_path):
    """`offload serve --pipeline-parallel-size 2` (two micro-batches in flight) answers a
    chat as one process does and its metrics count both schedulers' requests; with rank
    1 killed, the next request fails, and the server exits (status 2, one line naming the
    rank) instead of failing every later request."""
    from http_server import Server, chat_checkpoint, http

    from offload.probes.host import child_pids

    path = chat_checkpoint(tmp_path / "chat")
    chat = [{"role": "user", "content": "a b c"}]
    with LLM(str(path), device="cpu", enforce_eager=True) as llm:
        params = SamplingParams(temperature=0, max_tokens=8)
        expected = llm.chat(chat, params, use_tqdm=False)[0].outputs[0].text
    server = Server(
        path, "--pipeline-parallel-size", "2", "--pipeline-micro-batches", "2", "--enforce-eager"
    )
    try:
        client = server.client()
        for _ in range(2):
            answer = client.chat.completions.create(
                model="tiny", messages=chat, temperature=0, max_tokens=8
            )
            assert answer.choices[0].message.content == expected
        status, metrics = http(server.url + "/metrics")
        values = {
            line.split("{")[0]: float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith(("vllm:request_success_total{", "vllm:num_requests_running{"))
        }
        assert status == 200
        assert values == {"vllm:request_success_total": 2.0, "vllm:num_requests_running": 0.0}
        [rank1] = child_pids(server.process.pid)
        os.kill(rank1, signal.SIGKILL)
        with pytest.raises(openai.APIError):  # (an error status, or the connection closed)
            client.chat.completions.create(model="tiny", messages=chat, max_tokens=8)
        assert server.process.wait(timeout=30) == 2  # (the command's status for an error)
        lines = server.process.stderr.read().decode().strip().splitlines()
        assert lines[-1] == "offload: error: offload serve: pipeline rank 1 stopped"
    finally:
        server.stop()


def test_sliding_windows_and_chunked_prefills_over_the_pipeline(tmp_path):
    """Gemma 2 (sliding and full layers, soft-capped logits, a tied head) with prompts
    prefilled 4 tokens at a time inside the decode steps (mixed forwards): one process's
    tokens and logprobs."""
    zoo.save_with_tokenizer(zoo.build("gemma2"), tmp_path)
    prompts = [
        {"prompt_token_ids": [5, 9, 22, 7, 31, 4, 17, 60, 3, 11]},
        {"prompt_token_ids": [8, 12, 99]},
    ]
    kwargs = dict(max_model_len=64, max_num_batched_tokens=4, enforce_eager=True)
    answers = []
    for size in (1, 2):
        with LLM(str(tmp_path), pipeline_parallel_size=size, **kwargs) as llm:
            outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        answers.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs])
    assert answers[0] == answers[1]


def test_prompts_riding_in_decode_steps_over_the_pipeline_answer_as_one_process(
    attentive, monkeypatch
):
    """By default on a CPU, prompts that arrive while rows decode ride in their steps
    (`ChunkPace`; here a fixed budget of 9 tokens a turn): several in one forward, the
    last cut, over two ranks as in one process (the stages send back the rows' logits and
    each prompt's)."""
    from forwards import record_forwards

    from offload.engine.chunk_pace import ChunkPace

    monkeypatch.setattr(ChunkPace, "budget", lambda self, waiting, decoding: 9)
    prompts = [{"prompt_token_ids": [4 + (i * 13 + j * 5) % 90 for j in range(n)]}
               for i, n in enumerate((3, 5, 4, 2, 6, 12))]  # fmt: skip
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
        for n in (2, 12, 2, 2, 5, 4)
    ]
    answers = []
    for size in (1, 2):
        kwargs = dict(max_model_len=64, max_num_seqs=3, enforce_eager=True, device="cpu")
        with LLM(attentive, pipeline_parallel_size=size, **kwargs) as llm:
            events = record_forwards(monkeypatch)
            outputs = llm.generate(prompts, params, use_tqdm=False)
        answers.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs])
        assert any(e[0] == "mixed" and len(e) > 3 for e in events)
    assert answers[0] == answers[1]


def test_a_rank_with_a_slow_disk_takes_fewer_layers(attentive, monkeypatch):
    """Each rank's measured rates reach the split: rank 0 (made to say it is on a host of
    its own, whose probe finds a disk a thousand times slower than any) streams its
    whole stage from disk (a budget of 0), so it keeps the fewest layers, one; rank 1
    measures its own. (Ranks on one host take their host's median rates.)"""
    from pathlib import Path

    from offload.llm import pipelined
    from offload.probes.limits import rank_rates

    ram, _ = rank_rates(Path(attentive), 0)  # (rank 1's RAM measures alike: taken as equal)
    monkeypatch.setattr(pipelined, "rank_rates", lambda path, room: (ram, 0.001))
    monkeypatch.setattr(pipelined, "place_of", lambda device: "elsewhere cpu")
    kwargs = dict(device="cpu", enforce_eager=True, cpu_memory_gb=0, disk_io="direct")
    with LLM(attentive, pipeline_parallel_size=2, **kwargs) as llm:
        assert llm.model.held_layers == (0,)
        assert llm.generate("a b", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
