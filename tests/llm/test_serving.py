"""Continuous batching (`LLM.serving`, `LLM.stream`): requests that join and leave one
running batch get the tokens they would get alone, offloaded or not."""

import logging
import queue
import threading

import pytest
import torch
import zoo
from streams import last_output

from offload import ConfigError, SamplingParams
from offload.llm import cores
from offload.llm.llm import LLM

PROMPTS = ["t3 t4", "t5 t6 t7 t8 t9", "t10", "t11 t12 t13", "t7 t7 t7 t7", "t20 t21"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
OFFLOADED = {
    "prefetch": {"offload_group_size": 1, "offload_prefetch_step": 2},
    "disk": {"cpu_memory_gb": 0, "disk_io": "direct"},
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return zoo.save_attentive_llm(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def resident(checkpoint):
    with LLM(checkpoint) as llm:
        yield llm


@pytest.fixture(scope="module")
def alone(resident):
    return [resident.generate([p], GREEDY, use_tqdm=False)[0].outputs[0] for p in PROMPTS]


def _together(llm, prompts, params, max_num_seqs=8):
    """All requests queued at once (one schedule, whatever the timing): their outputs.
    `params`: one SamplingParams for all, or one each."""
    serving = llm.serving(max_num_seqs)
    queues = [queue.Queue() for _ in prompts]
    each = params if isinstance(params, list) else [params] * len(prompts)
    requests = [
        serving.prepare(p, llm.get_tokenizer()(p).input_ids, r, q.put)
        for p, r, q in zip(prompts, each, queues, strict=True)
    ]
    serving.core.submit_all(requests)
    return [last_output(q) for q in queues]


def _logprobs(output):
    return [{t: lp.logprob for t, lp in entry.items()} for entry in output.logprobs]


def test_requests_batched_together_get_their_tokens_alone(checkpoint, alone):
    with LLM(checkpoint) as llm:
        outputs = _together(llm, PROMPTS, GREEDY)
    for got, expected in zip(outputs, alone, strict=True):
        assert got.outputs[0].token_ids == expected.token_ids
        assert got.outputs[0].text == expected.text


@pytest.mark.parametrize("setting", list(OFFLOADED))
def test_offloaded_serving_is_bitwise_the_resident_serving(checkpoint, setting):
    with LLM(checkpoint) as llm:
        expected = _together(llm, PROMPTS, GREEDY, max_num_seqs=4)
    with LLM(checkpoint, **OFFLOADED[setting]) as llm:
        got = _together(llm, PROMPTS, GREEDY, max_num_seqs=4)
        moved = llm.offloader.stats()
    assert moved.bytes_copied > 0 or moved.disk.bytes_read > 0  # the weights really streamed
    for a, b in zip(got, expected, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert _logprobs(a.outputs[0]) == _logprobs(b.outputs[0])  # exact floats


def test_streams_from_threads_join_the_running_batch(resident, alone):
    """Clients that arrive while others decode: each gets its own tokens, streamed."""
    results, seen = [None] * len(PROMPTS), [0] * len(PROMPTS)

    def client(index):
        for output in resident.stream(PROMPTS[index], GREEDY):
            seen[index] += 1
            results[index] = output

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for got, expected, count in zip(results, alone, seen, strict=True):
        assert got.finished and got.outputs[0].token_ids == expected.token_ids
        assert count == len(expected.token_ids)  # one output per token


def test_more_requests_than_rows_wait_and_all_finish(checkpoint, resident):
    """Three rows for six requests of different lengths: each that finishes leaves a row
    that the last running one is packed into, and a waiting request takes the free one."""
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 12, 5, 9, 2, 7)
    ]
    expected = [
        resident.generate([p], r, use_tqdm=False)[0].outputs[0].token_ids
        for p, r in zip(PROMPTS, params, strict=True)
    ]
    with LLM(checkpoint) as llm:
        outputs = _together(llm, PROMPTS, params, max_num_seqs=3)
        assert llm.serving().core.max_rows == 3
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_a_stream_left_early_frees_its_row(checkpoint):
    with LLM(checkpoint) as llm:
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        for count, _ in enumerate(llm.stream("t3 t4", long)):
            if count == 2:
                break  # the generator is closed: the request is cancelled
        engine = llm.serving().core
        for _ in range(200):
            if engine.num_running == 0 and engine.num_waiting == 0:
                break
            threading.Event().wait(0.01)
        assert engine.num_running == 0 and engine.num_waiting == 0
        again = list(llm.stream("t3 t4", SamplingParams(temperature=0, max_tokens=3)))
        assert again[-1].finished and len(again[-1].outputs[0].token_ids) == 3


def test_n_sequences_and_seeds_as_generate(resident):
    params = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    expected = resident.generate(["t5 t6"], params, use_tqdm=False)[0]
    got = list(resident.stream("t5 t6", params))[-1]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in expected.outputs]


def test_requests_that_cannot_fit_are_refused_at_once(checkpoint):
    with LLM(checkpoint, max_num_seqs=2) as llm:
        with pytest.raises(ConfigError, match="max_model_len"):
            list(llm.stream({"prompt_token_ids": [5] * llm.max_model_len}, GREEDY))
        with pytest.raises(ConfigError, match="max_num_seqs"):
            list(llm.stream("t3", SamplingParams(n=3, max_tokens=1)))
        assert list(llm.stream("t3", SamplingParams(n=2, max_tokens=1)))[-1].finished


def test_a_failing_forward_fails_its_requests_and_the_engine_goes_on(checkpoint, monkeypatch):
    from offload.engine.rows import RowStep

    with LLM(checkpoint) as llm:
        engine = llm.serving().core
        real = RowStep.__call__
        calls = {"n": 0}

        def failing_once(step):
            calls["n"] += 1
            if calls["n"] == 1:  # the first decode step
                raise OSError("injected read error")
            return real(step)

        monkeypatch.setattr(RowStep, "__call__", failing_once)
        with pytest.raises(OSError, match="injected"):
            list(llm.stream("t3 t4", GREEDY))
        assert isinstance(engine.last_error, OSError)
        out = list(llm.stream("t3 t4", GREEDY))[-1]
        assert out.finished and engine.last_error is None
        assert torch.tensor(out.outputs[0].token_ids).numel() == GREEDY.max_tokens


GIB = 2**30


@pytest.mark.parametrize(
    ("free", "rows", "length", "fixed", "expected"),
    [
        (GIB, 16, 1000, False, (16, 1000)),  # fits as asked
        (4 * GIB, 16, 8192, False, (16, 5825)),  # shorter rows (SmolLM2 in fp32 on a CPU)
        (GIB, 16, 8192, False, (11, 2048)),  # rows of 2048 positions at least, then fewer
        (4 * GIB, 16, 8192, True, (11, 8192)),  # the length asked for: fewer rows
        (GIB, 16, 1000, True, (16, 1000)),
    ],
)
def test_rows_are_planned_within_the_kv_budget(free, rows, length, fixed, expected):
    from offload.llm.serving import plan_rows

    plan = plan_rows(46080, free, rows, length, fixed)
    assert (plan.rows, plan.length) == expected
    assert plan.rows * plan.length * 46080 <= free


def test_a_budget_without_room_for_one_row_is_refused():
    from offload.llm.serving import plan_rows

    with pytest.raises(ConfigError, match="max_model_len"):
        plan_rows(46080, 2**20, 4, 8192, True)


def test_requests_longer_than_a_row_are_refused_and_limits_clamped(checkpoint, monkeypatch, caplog):
    from offload.llm import serving

    with LLM(checkpoint, max_num_seqs=4) as llm:
        per_position = serving.bytes_per_row(llm.model.config, 1, torch.float32)
        monkeypatch.setattr(serving, "CPU_KV_BYTES", 400 * per_position)  # a room of 400
        with caplog.at_level(logging.WARNING, logger="offload"):
            served = llm.serving()
        assert "sequences of up to 319 positions run, 4 at once sharing it" in caplog.text
        # Four rows share the room (preempting where they outgrow it), each at most as long
        # as the room holds less the pages a row may not use (`row_pages`): 64 columns
        # of this model's 16-wide heads to a page.
        assert served.core.max_rows == 4 and served.core.scheduler.room == 400
        assert served.max_model_len == (400 // 64 - 1) * 64 - 1 < llm.max_model_len
        with pytest.raises(ConfigError, match=f"max_model_len={served.max_model_len}"):
            list(llm.stream({"prompt_token_ids": [5] * served.max_model_len}, GREEDY))
        out = list(llm.stream("t3 t4", SamplingParams(temperature=0, max_tokens=None)))[-1]
        assert len(out.outputs[0].token_ids) <= served.max_model_len - 2


def test_a_fault_of_the_engine_itself_fails_the_requests_and_it_goes_on(checkpoint):
    with LLM(checkpoint) as llm:
        scheduler = llm.serving().core.scheduler
        real, calls = scheduler._admit, {"n": 0}

        def failing_once(*args):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected engine fault")
            return real(*args)

        scheduler._admit = failing_once
        with pytest.raises(RuntimeError, match="injected"):
            list(llm.stream("t3 t4", GREEDY))  # an error, not a hang
        assert list(llm.stream("t3 t4", GREEDY))[-1].finished


def test_the_loop_runs_in_the_callers_thread_as_in_its_own(checkpoint):
    """`engine_thread=False` (what `offload serve` does, on the main thread): the same
    tokens as the engine's own thread; `close` from the loop's own thread (a signal
    handler there) ends `run`, and requests still queued get an error."""
    with LLM(checkpoint) as llm:
        expected = _together(llm, PROMPTS, GREEDY, max_num_seqs=4)
    with LLM(checkpoint) as llm:
        serving = llm.serving(4, engine_thread=False)
        results = {}

        def client():
            results["done"] = _together(llm, PROMPTS, GREEDY, max_num_seqs=4)
            late = queue.Queue()
            serving.core.submit_all([serving.prepare("t3", [3], GREEDY, late.put)])
            results["late"] = late

        def stop_from_the_loop(rows, logits, *rest):  # runs in the loop's thread, as a handler
            if "done" in results:
                serving.close()
            picked(rows, logits, *rest)

        picked = serving.core._pick
        serving.core._pick = stop_from_the_loop
        thread = threading.Thread(target=client)
        thread.start()
        serving.core.run()  # returns once closed
        thread.join(timeout=60)
        assert threading.current_thread() is threading.main_thread()
    got = results["done"]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert [_logprobs(o.outputs[0]) for o in got] == [_logprobs(o.outputs[0]) for o in expected]
    with pytest.raises(Exception, match="shutting down"):
        last_output(results["late"])


def test_a_batch_on_the_cpu_runs_the_few_rows_linear(checkpoint, monkeypatch):
    """A forward of a few rows takes `weight @ x.T` (MKL repacks the weight for
    `x @ weight.T` over a few rows), a one-row step the batched matrix-vector product; a
    model whose float32 weights are too small for it to pay takes neither."""
    import offload.engine.cpu_linear as cpu_linear
    from offload.quant import row_dot

    monkeypatch.setattr(row_dot, "library", lambda: None)  # (the forms without our kernels)
    taken = []
    real = cpu_linear.few_rows_linear

    def counting(x, *args, **kwargs):
        out = real(x, *args, **kwargs)
        taken.append((x.numel() // x.shape[-1], out is not None))
        return out

    monkeypatch.setattr(cpu_linear, "few_rows_linear", counting)
    one = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(checkpoint) as llm:  # (tiny: the mode would cost more than it saves)
        _together(llm, PROMPTS[:4], one)
    assert taken == []
    monkeypatch.setattr(cpu_linear, "PAYS_BYTES", 0)  # as for a model of large weights
    with LLM(checkpoint) as llm:
        _together(llm, PROMPTS[:4], one)
    assert (4, True) in taken  # the decode steps of four rows
    assert all(used == (1 <= rows <= 64) for rows, used in taken)


def test_a_served_request_gets_its_prompt_logprobs_whatever_runs_beside_it(checkpoint):
    """`prompt_logprobs` on the engine core (prefilled in chunks of 4 tokens, `n` 2): each
    prompt's entries and its first token's logprobs the same alone and beside other
    requests up to rounding (beside them, its chunks ride in their decode steps:
    `mixed_step`), and `generate`'s; its tokens the same."""
    asked = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=3, n=2
    )
    prompts = ["t3 t4 t5 t6 t7 t8 t9 t10 t11", "t12", "t5 t6 t7"]
    with LLM(checkpoint, max_num_batched_tokens=4) as llm:
        expected = [llm.generate([p], asked, use_tqdm=False)[0] for p in prompts]
        alone = [_together(llm, [p], [asked])[0] for p in prompts]
        served = _together(llm, prompts, [asked, GREEDY, asked])
    for index in (0, 2):
        got, want = served[index], alone[index]
        assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(
            want.prompt_token_ids
        )
        for other in (want, expected[index]):
            _assert_close(got.prompt_logprobs[1:], other.prompt_logprobs[1:])
            for mine, theirs in zip(got.outputs, other.outputs, strict=True):
                assert mine.token_ids == theirs.token_ids
                _assert_close(mine.logprobs[:1], theirs.logprobs[:1])
    assert served[1].prompt_logprobs is None


def _assert_close(entries, others):
    assert len(entries) == len(others)
    for entry, other in zip(entries, others, strict=True):
        assert entry.keys() == other.keys()
        for token, logprob in entry.items():
            assert logprob.logprob == pytest.approx(other[token].logprob, abs=1e-5)


@pytest.mark.parametrize("weights", ["resident", "prefetch"])
def test_kv_offload_serves_the_resident_servers_bits(checkpoint, weights):
    """The rows' KV cache in host memory (`kv_offload`, streamed per layer through two
    slots): requests queued at once get bit for bit the tokens and logprobs of the server
    whose cache is on the device, n > 1 and chunked prompts included, and the cache's
    bytes really moved (brought in, and written back)."""
    settings = {} if weights == "resident" else OFFLOADED["prefetch"]
    params = [GREEDY, SamplingParams(temperature=0, max_tokens=7, n=2, logprobs=1)] * 3
    with LLM(checkpoint, max_num_batched_tokens=3, **settings) as llm:
        expected = _together(llm, PROMPTS, params, max_num_seqs=4)
    with LLM(checkpoint, max_num_batched_tokens=3, kv_offload=True, **settings) as llm:
        got = _together(llm, PROMPTS, params, max_num_seqs=4)
        kv = llm.serving().core.runner.cache.kv_offloader.stats()
    assert kv.bytes_copied > 0 and kv.bytes_written_back > 0
    for a, b in zip(got, expected, strict=True):
        for mine, theirs in zip(a.outputs, b.outputs, strict=True):
            assert mine.token_ids == theirs.token_ids
            assert _logprobs(mine) == _logprobs(theirs)  # exact floats


class _CompilingStep:
    """A compiled step that is not ready for its first `ready_after` calls (None: the core
    runs the step eagerly, as while a real one compiles in the background), then runs
    the step (eagerly here) and counts the call as compiled."""

    def __init__(self, ready_after: int):
        self.calls, self.ready_after, self.compiled_rows = 0, ready_after, []

    def usable(self, step) -> bool:
        return True

    def ready(self, step) -> bool:
        return self.calls >= self.ready_after

    def __call__(self, step, checked_once: bool = False):
        self.calls += 1
        if self.calls <= self.ready_after:
            return None
        self.compiled_rows.append(step.columns.shape[0])
        return step()


def test_an_answer_begun_eagerly_while_its_step_compiles_ends_eagerly(checkpoint, monkeypatch):
    """With `keep_form`: the compiled step becomes ready while a request decodes: its steps stay
    eager to its end (its bits must not depend on when the compile ended); a request that
    starts once it is alone-free of eager rows runs compiled."""
    with LLM(checkpoint) as llm:
        fake = _CompilingStep(ready_after=1)
        monkeypatch.setattr(cores, "compiled_step", lambda llm: fake)
        serving = llm.serving(2)
        serving.core.runner.keep_form = True  # (as `generate`'s static batch has it)
        first = _together(llm, ["t3 t4"], GREEDY, max_num_seqs=2)[0]
        assert fake.calls == 1 and fake.compiled_rows == []  # (asked once; all of it eager)
        second = _together(llm, ["t3 t4"], GREEDY, max_num_seqs=2)[0]
        assert len(fake.compiled_rows) == len(second.outputs[0].token_ids) - 1
        assert serving.core is llm.serving().core
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


def test_a_server_switches_to_its_compiled_step_as_soon_as_it_is_ready(checkpoint, monkeypatch):
    """Without `keep_form` (the server's default): the step compiled in the background is
    used from the first step after it is ready, whoever began eagerly (else steady traffic
    would keep every row eager)."""
    with LLM(checkpoint) as llm:
        fake = _CompilingStep(ready_after=1)
        monkeypatch.setattr(cores, "compiled_step", lambda llm: fake)
        first = _together(llm, ["t3 t4"], GREEDY, max_num_seqs=2)[0]
    assert len(fake.compiled_rows) == len(first.outputs[0].token_ids) - 2  # (all but 1 step)
