"""One engine, one answer: `LLM.generate`, `LLM.chat`, `LLM.stream` and `offload serve`
(its app, spoken to with the `openai` client) run the same engine core, so the same
prompts and sampling settings give the same tokens and log-probabilities bit for bit —
one request at a time, and N requests that reach the core at one step boundary against
`generate` of the same N prompts — resident, offloaded (UVA, prefetch, the disk tier)
and with the KV cache in host memory."""

import queue

import pytest
from http_server import InProcess, chat_checkpoint

from offload import SamplingParams
from offload.llm.llm import LLM

PROMPTS = ["t3 t4", "t5 t6 t7 t8 t9", "t10", "t11 t12 t13"]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(
    temperature=0.9, top_p=0.9, seed=7, max_tokens=6, ignore_eos=True, logprobs=2
)
SETTINGS = {
    "resident": {},
    "uva": {"cpu_offload_gb": 0.0002},
    "prefetch": {"offload_group_size": 1, "offload_prefetch_step": 2},
    "disk": {"cpu_memory_gb": 0, "disk_io": "direct"},
    "kv offload": {"kv_offload": True},
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return chat_checkpoint(tmp_path_factory.mktemp("one-engine"))


def _answers(outputs) -> list:
    """Each completion's tokens and every log-probability it carries, as exact floats."""
    return [
        (c.token_ids, [{t: lp.logprob for t, lp in entry.items()} for entry in c.logprobs])
        for output in outputs
        for c in output.outputs
    ]


def _served_together(llm, ids, params) -> list:
    """All requests queued at once on the server's core (one step boundary)."""
    serving = llm.serving()
    queues = [queue.Queue() for _ in ids]
    requests = [
        serving.prepare(None, prompt, request, q.put)
        for prompt, request, q in zip(ids, params, queues, strict=True)
    ]
    serving.core.submit_all(requests)
    finals = []
    for q in queues:
        item = q.get(timeout=120)
        while not isinstance(item, BaseException) and not item.finished:
            item = q.get(timeout=120)
        if isinstance(item, BaseException):
            raise item
        finals.append(item)
    return finals


def _complete(client, prompt_ids: list[int], params: SamplingParams):
    extra = {"ignore_eos": True, "top_k": params.top_k}
    return client.completions.create(
        model="tiny", prompt=[prompt_ids], max_tokens=params.max_tokens,
        temperature=params.temperature, top_p=params.top_p, seed=params.seed,
        logprobs=params.logprobs, extra_body=extra,
    )  # fmt: skip


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_generate_chat_stream_and_serve_give_one_answer(checkpoint, setting):
    with LLM(checkpoint, max_model_len=64, **SETTINGS[setting]) as llm:
        moved = llm.transfer_stats()
        tokenizer = llm.get_tokenizer()
        ids = [tokenizer(p).input_ids for p in PROMPTS]
        params = [GREEDY, SEEDED] * (len(PROMPTS) // 2)
        requests = [{"prompt_token_ids": i} for i in ids]
        together = llm.generate(requests, params, use_tqdm=False)
        alone = [
            llm.generate([r], [p], use_tqdm=False)[0] for r, p in zip(requests, params, strict=True)
        ]
        # The chats: the same answers as generate of their templated prompts.
        chats = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
        templated = [{"prompt_token_ids": o.prompt_token_ids} for o in chats]
        assert _answers(chats) == _answers(llm.generate(templated, params, use_tqdm=False))
        # One at a time: streamed, and through the server's app with the openai client.
        streamed = [list(llm.stream(r, p))[-1] for r, p in zip(requests, params, strict=True)]
        assert _answers(streamed) == _answers(alone)
        app = InProcess(llm)
        client = app.client()
        try:
            for prompt, request, output in zip(ids, params, alone, strict=True):
                choice = _complete(client, prompt, request).choices[0]
                [(tokens, logprobs)] = _answers([output])
                assert choice.text == output.outputs[0].text
                chosen = [entry[token] for entry, token in zip(logprobs, tokens, strict=True)]
                assert choice.logprobs.token_logprobs == chosen
            # N requests at one step boundary: as generate of the same N prompts.
            assert _answers(_served_together(llm, ids, params)) == _answers(together)
        finally:
            app.stop()
        moved = llm.transfer_stats() - moved
        offloaded = llm.offloader.offloaded_bytes
    # (the weights, or the KV cache, really were elsewhere, and bytes moved)
    assert (offloaded > 0) == (setting in ("uva", "prefetch", "disk"))
    if setting in ("prefetch", "disk"):
        assert moved.weight_copied_bytes + moved.disk_read_bytes > 0
    assert (moved.kv_copied_bytes > 0) == (setting == "kv offload")


@pytest.mark.parametrize("setting", ["resident", "prefetch and kv offload"])
def test_the_stored_default_model_gives_one_answer(smollm2_path, setting):
    flags = {} if setting == "resident" else {**SETTINGS["prefetch"], "kv_offload": True}
    prompts = ["The capital of France is", "1, 2, 3,"]
    params = [GREEDY, SEEDED]
    with LLM(smollm2_path, max_model_len=128, **flags) as llm:
        requests = [{"prompt_token_ids": llm.get_tokenizer()(p).input_ids} for p in prompts]
        together = llm.generate(requests, params, use_tqdm=False)
        alone = [
            llm.generate([r], [p], use_tqdm=False)[0] for r, p in zip(requests, params, strict=True)
        ]
        streamed = [list(llm.stream(r, p))[-1] for r, p in zip(requests, params, strict=True)]
        assert _answers(streamed) == _answers(alone)
        ids = [r["prompt_token_ids"] for r in requests]
        assert _answers(_served_together(llm, ids, params)) == _answers(together)
