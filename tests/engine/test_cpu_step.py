"""The compiled CPU decode step (engine/cpu_step.py): where `LLM` takes it, and that it gives
offloaded the bits it gives resident."""

import gc
import os
import pickle

import pytest
import torch
import torch.nn.functional as F

from offload import SamplingParams
from offload.engine import compiled_step, cpu_linear, cpu_step, mixed_step, step_cache
from offload.engine.cpu_step import cache_length
from offload.engine.step_linears import step_linear, step_products
from offload.llm.llm import LLM
from offload.quant import row_dot
from tests import zoo

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

# Greedy with the top logprobs of every step: equal floats there mean equal logits rows.
GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=5, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 9, 14, 3, 27, 8, 11]}
OFFLOADS = {
    "uva": {"cpu_offload_gb": 0.0005},
    "prefetch": {"offload_group_size": 1, "offload_prefetch_step": 1},
    "disk": {"cpu_memory_gb": 0},
    "kv-cache": {"kv_offload": True},
}


def test_the_cache_length_is_a_power_of_two_within_max_model_len():
    assert cache_length(9, 2048) == 128
    assert cache_length(128, 2048) == 128
    assert cache_length(129, 2048) == 256
    assert cache_length(300, 400) == 400  # capped by the model's length
    assert cache_length(60, 64) == 64
    assert cache_length(70, 64) == 70  # never shorter than asked


def test_step_products_are_the_linears_for_a_few_float32_rows():
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 40), torch.randn(96)
    for rows in (1, 2, cpu_linear.MAX_ROWS):
        x = torch.randn(1, rows, 40)
        torch.testing.assert_close(step_linear(x, weight, bias), F.linear(x, weight, bias))
        torch.testing.assert_close(step_linear(x, weight), F.linear(x, weight))
    assert step_linear(torch.randn(cpu_linear.MAX_ROWS + 1, 40), weight) is None
    assert step_linear(torch.randn(1, 40).bfloat16(), weight) is None  # (mixed dtypes)
    assert step_linear(torch.randn(1, 40).double(), weight.double()) is None


@pytest.mark.parametrize(
    ("rows", "dtype", "rewritten"),
    [(1, torch.float32, 2), (2, torch.float32, 2), (65, torch.float32, 0), (1, torch.bfloat16, 2),
     (2, torch.float16, 2), (1, torch.float64, 0)],
)  # fmt: skip
def test_the_step_graph_takes_its_products_for_a_few_float_rows(rows, dtype, rewritten):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 96), torch.nn.ReLU(), torch.nn.Linear(96, 8))
    model = model.to(dtype)
    counts = []

    def backend(graph_module, example_inputs):
        counts.append(step_products(graph_module.graph))
        graph_module.recompile()
        return graph_module.forward

    x = torch.randn(1, rows, 40, dtype=dtype)
    with torch.no_grad():
        out = torch.compile(model, backend=backend, dynamic=False)(x)
        close = {} if dtype != torch.float16 else {"rtol": 1e-2, "atol": 1e-3}  # (a rounding)
        torch.testing.assert_close(out, model(x), **close)
    assert counts == [rewritten]


# The graphs a float32 model's steps compile: one for every row count where the
# row-invariant products are built (a lone row runs beside a padding row), else a lone
# row's and the batches'.
GRAPHS = ["rows"] if row_dot.library() is not None else ["row", "rows"]
LONE = GRAPHS[0]  # the graph a lone row runs in
LONE_WHAT = "a lone row" if LONE == "row" else "batches of 2 to 64 rows"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return zoo.save_attentive_llm(tmp_path_factory.mktemp("tiny"), num_layers=3)


@pytest.fixture
def compiles(monkeypatch, tmp_path):
    """The compiled step on (the suite turns it off), the tiny model counts as one whose
    step pays for compiling, and steps are kept in a folder of the test's own."""
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(cpu_step.ENV, "wait")
    monkeypatch.setattr(cpu_linear, "PAYS_BYTES", 0)


def _run(llm):
    [out] = llm.generate(PROMPT, GREEDY, use_tqdm=False)
    return out.outputs[0].token_ids, out.outputs[0].logprobs


def _resident_runs(checkpoint, run, shape: tuple[int, int]):
    """`run` of the resident model compiled (its step of `shape` only), and eager."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(cpu_step.ENV, "wait")
        patch.setattr(cpu_linear, "PAYS_BYTES", 0)
        llm = LLM(checkpoint, device="cpu", dtype="float32")
        result = run(llm)
        assert llm._cpu_step is not None and set(llm._cpu_step._steps) == {shape}
        # Again through the kept step: its guards checked at a loop's first step only
        # (the weights stay in place), the same bits.
        checks = _guard_checks(llm)
        assert run(llm) == result and _guard_checks(llm) == checks + 1
        eager = run(LLM(checkpoint, device="cpu", dtype="float32", enforce_eager=True))
    return result, eager


def _guard_checks(llm) -> int:
    """How often the kept steps of `llm` have checked their guards, all shapes."""
    return sum(getattr(step, "guard_checks", 0) for step in llm._cpu_step._steps.values())


@pytest.fixture(scope="module")
def resident_compiled(checkpoint):
    return _resident_runs(checkpoint, _run, (LONE,))  # (a lone row)


@pytest.mark.parametrize("setting", list(OFFLOADS))
def test_compiled_offloaded_equals_compiled_resident_bitwise(
    checkpoint, resident_compiled, compiles, setting, capsys
):
    llm = LLM(checkpoint, device="cpu", dtype="float32", **OFFLOADS[setting])
    assert _run(llm) == resident_compiled[0]
    assert f"compiling the CPU decode step for {LONE_WHAT}" in capsys.readouterr().err
    # (KV offload's graph names its offloader's id, a constant: part of the key)
    assert llm._cpu_step is not None and len(llm._cpu_step._steps) == 1
    [key] = llm._cpu_step._steps
    assert key[0] == LONE and ("kv" in key) == (setting == "kv-cache")
    # Kept on disk (prefetch hooks and KV offload's layers name their offloader by id),
    # in one graph (KV offload's cache update is one op).
    assert {path.suffix for path in step_cache.folder().glob("*")} == {".pt2", ".digest"}
    assert llm._cpu_step.graphs == {key: 1}
    moved = llm.transfer_stats()
    assert moved.num_compiled_steps == GREEDY.max_tokens - 1  # (the first token: the prefill's)
    # Run again through the kept step: where weights or cache move between steps, its
    # guards are checked at every step; UVA reads its slabs in place: at the first only.
    # (with KV offload, the call's offloader may get another id: another step, loaded)
    checks = _guard_checks(llm)
    assert _run(llm) == resident_compiled[0]
    every = GREEDY.max_tokens - 1
    assert _guard_checks(llm) - checks == (1 if setting == "uva" else every)
    if setting == "kv-cache":
        assert moved.kv_copied_bytes > 0
    else:
        assert llm.offloader.offloaded_bytes > 0
        streamed = moved.weight_copied_bytes + moved.disk_read_bytes + moved.disk_mapped_bytes
        assert streamed > 0 or setting == "uva"  # (UVA reads in place on a CPU)


def test_a_call_whose_kv_offloader_gets_another_id_runs_a_step_that_names_it(
    checkpoint, resident_compiled, compiles
):
    """A compiled step with KV offload names its core's KV offloader by id, a constant of
    its graph. A call that needs more rows makes a larger core, whose offloader gets the
    smallest free id, which may be another one (the last one's id still held, or freed
    while a lower one came free): its step must name the new id, never the old (missing:
    an error; another offloader's: the wrong cache)."""
    from offload.offloader import ops

    holder = type("Holder", (), {})()  # (holds the smallest free id for the first call)
    held = ops.register(holder)
    llm = LLM(checkpoint, device="cpu", dtype="float32", **OFFLOADS["kv-cache"])
    assert _run(llm) == resident_compiled[0]
    [(*_, first)] = llm._cpu_step._steps
    ops.unregister(held)  # the next core's KV offloader takes it (or a lower id freed since)
    given, register = [], ops.register
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ops, "register", lambda owner: (given.append(register(owner)), given[-1])[1])
        longer = SamplingParams(temperature=0, max_tokens=130, logprobs=5, ignore_eos=True)
        [out] = llm.generate(PROMPT, longer, use_tqdm=False)  # (256 positions: a new core)
    tokens, logprobs = resident_compiled[0]
    assert out.outputs[0].token_ids[: len(tokens)] == tokens
    assert out.outputs[0].logprobs[: len(tokens)] == logprobs
    [second] = given  # (the new core's KV offloader's)
    assert second != first and second <= held
    assert {key[-1] for key in llm._cpu_step._steps} == {first, second}


def test_the_compiled_step_gives_the_eager_steps_bits(resident_compiled):
    """Its sums run ATen's kernels as the eager step's do (`engine/step_order`): the same
    tokens and logprobs, bit for bit, so an answer does not depend on which step ran it."""
    compiled, eager = resident_compiled
    assert compiled == eager


def test_enforce_eager_large_batches_and_small_models_stay_eager(checkpoint, compiles, monkeypatch):
    eager = LLM(checkpoint, device="cpu", dtype="float32", enforce_eager=True)
    _run(eager)
    assert eager._cpu_step is None and eager.transfer_stats().num_compiled_steps == 0
    monkeypatch.setattr(cpu_linear, "MAX_ROWS", 1)  # (a batch past the rows it writes)
    batched = LLM(checkpoint, device="cpu", dtype="float32")
    batched.generate([PROMPT, PROMPT], GREEDY, use_tqdm=False)
    assert batched._cpu_step is None
    monkeypatch.setattr(cpu_linear, "PAYS_BYTES", 16 * 2**20)
    small = LLM(checkpoint, device="cpu", dtype="float32")
    _run(small)
    assert small._cpu_step is None
    monkeypatch.setattr(cpu_linear, "PAYS_BYTES", 0)
    monkeypatch.setenv(cpu_step.ENV, "0")
    switched_off = LLM(checkpoint, device="cpu", dtype="float32")
    _run(switched_off)
    assert switched_off._cpu_step is None


BATCH = [PROMPT, {"prompt_token_ids": [7, 3, 30, 2]}]  # (rows of other lengths: padded)


def _run_batch(llm):
    outs = llm.generate(BATCH, GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def test_a_trace_that_breaks_says_so_and_one_that_fails_counts_as_eager(
    checkpoint, resident_compiled, compiles, capsys, monkeypatch
):
    """A step whose trace breaks into pieces runs them and says how many; one where
    dynamo compiles nothing runs the eager step, and its steps do not count as compiled
    (they did, silently, before)."""
    torch._dynamo.reset()  # (the step's inner frames may have met their recompile limit)
    llm = LLM(checkpoint, device="cpu", dtype="float32")

    def refuses(module, args):  # a raise inside the trace only: dynamo splits around it
        if torch.compiler.is_compiling():
            raise RuntimeError("not traceable")

    handle = llm.model.model.layers[1].register_forward_pre_hook(refuses)
    tokens, _ = _run(llm)
    handle.remove()
    assert len(tokens) == GREEDY.max_tokens
    [graphs] = llm._cpu_step.graphs.values()
    assert graphs > 1 and f"in {graphs} graphs: its trace broke" in capsys.readouterr().err
    assert llm.transfer_stats().num_compiled_steps == GREEDY.max_tokens - 1

    monkeypatch.setattr(step_cache, "keepable", lambda step: False)
    monkeypatch.setattr(compiled_step.CompiledCpuStep, "_traced", property(lambda self: _run_step))
    failed = LLM(checkpoint, device="cpu", dtype="float32")
    # (the eager step's tokens; its first step ran as dynamo left it, without cpu_linear's
    # products, so its last bits may differ)
    assert _run(failed)[0] == resident_compiled[1][0]
    assert "nothing compiled: its trace failed" in capsys.readouterr().err
    assert failed.transfer_stats().num_compiled_steps == 0


def _run_step(step):
    return step()


def test_a_rounded_cache_beyond_swap_space_decodes_eagerly(checkpoint, compiles):
    """The compiled step's cache is rounded up to 128 positions; where that much host KV
    would pass swap_space, the step runs eagerly on the cache the request needs."""
    llm = LLM(checkpoint, device="cpu", dtype="float32", kv_offload=True, swap_space=0.00005)
    tokens, _ = _run(llm)
    assert len(tokens) == GREEDY.max_tokens and llm.transfer_stats().num_compiled_steps == 0


def test_prompts_of_other_lengths_reuse_the_compiled_step(checkpoint, compiles):
    """Every input of the step is laid out alike for any prompt length within one cache
    length, so the graph is traced once (a position column cut from the prompt's kept its
    width as a stride, and each new length traced and compiled again, silently)."""
    from torch._dynamo.utils import counters

    llm = LLM(checkpoint, device="cpu", dtype="float32")
    _run(llm)
    graphs = counters["stats"]["unique_graphs"]
    for length in (3, 12, 40):
        llm.generate({"prompt_token_ids": list(range(5, 5 + length))}, GREEDY, use_tqdm=False)
    assert counters["stats"]["unique_graphs"] == graphs
    assert set(llm._cpu_step._steps) == {(LONE,)}
    assert llm.transfer_stats().num_compiled_steps == 4 * (GREEDY.max_tokens - 1)
    # A call of more positions than the first call's cache held (a core of 256 columns
    # made anew): the same graph, its cache's size dynamic.
    longer = SamplingParams(temperature=0, max_tokens=130, ignore_eos=True)
    llm.generate(PROMPT, longer, use_tqdm=False)
    assert llm._generator.core.max_len == 256
    assert counters["stats"]["unique_graphs"] == graphs
    assert llm.transfer_stats().num_compiled_steps == 4 * (GREEDY.max_tokens - 1) + 129


def test_an_llm_made_after_one_dropped_without_close_loads_its_kept_step(checkpoint, compiles):
    """A model lives on after it is dropped (its reference cycles wait for a collection),
    holding its offloader's id, which a compiled step holds as a constant: the next LLM of
    the same model and setting still takes that id, so it loads the step the dropped one
    kept instead of compiling another."""
    offloaded = {"cpu_memory_gb": 0}
    enabled = gc.isenabled()
    gc.disable()  # (no collection of Python's own between the two: only the LLM's)
    try:
        first = LLM(checkpoint, device="cpu", dtype="float32", **offloaded)
        result = _run(first)
        assert first._cpu_step.loaded == 0
        del first
        second = LLM(checkpoint, device="cpu", dtype="float32", **offloaded)
        assert _run(second) == result
        assert second._cpu_step.loaded == 1 and second._cpu_step.compile_s < 5
    finally:
        if enabled:
            gc.enable()


def test_a_second_llm_loads_the_kept_step_and_gives_its_bits(checkpoint, compiles):
    """The step compiled ahead of time is kept on disk; the next LLM of the same model and
    setting loads it (no trace) and computes the same bits. Another setting, a model
    config that differs in one value, or a file planted there: compiled, never loaded."""
    from torch._dynamo.utils import counters

    first = LLM(checkpoint, device="cpu", dtype="float32")
    result = _run(first)
    [kept] = list(step_cache.folder().glob("*.pt2"))
    assert first._cpu_step.loaded == 0
    graphs = counters["stats"]["unique_graphs"]
    os.utime(kept, (1, 1))
    second = LLM(checkpoint, device="cpu", dtype="float32")
    assert _run(second) == result
    assert second._cpu_step.loaded == 1 and counters["stats"]["unique_graphs"] == graphs
    assert kept.stat().st_mtime > 1  # loaded: used now, the last to be pruned
    assert second.transfer_stats().num_compiled_steps == GREEDY.max_tokens - 1

    other = LLM(checkpoint, device="cpu", dtype="float32", cpu_offload_gb=0.0005)
    assert _run(other) == result and other._cpu_step.loaded == 0  # (UVA: its own file)
    assert len(list(step_cache.folder().glob("*.pt2"))) == 2

    # Planted: a pickle that would run code when unpickled, without this cache's signature.
    marker = kept.parent.parent / "the code ran"
    kept.write_bytes(pickle.dumps(_RunsCode(marker)))
    broken = LLM(checkpoint, device="cpu", dtype="float32")
    assert _run(broken) == result and broken._cpu_step.loaded == 0
    assert not marker.exists()
    assert step_cache.load(kept) is not None  # compiled again, kept and signed


class _RunsCode:
    """Unpickled, it would create the file it names."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("setting", ["prefetch", "disk"])
def test_an_offloaded_step_is_kept_and_loads_with_its_bits(
    checkpoint, resident_compiled, compiles, setting
):
    """A step with prefetch hooks (the disk tier's too) is kept like a resident one: the
    next LLM loads it, traces nothing, still waits for and refills its slots (bytes move)
    and gives the compiled resident bits."""
    from torch._dynamo.utils import counters

    gc.collect()  # (offloaders are in reference cycles) the earlier tests' ids are free
    first = LLM(checkpoint, device="cpu", dtype="float32", **OFFLOADS[setting])
    assert _run(first) == resident_compiled[0] and first._cpu_step.loaded == 0
    del first
    gc.collect()  # its id is free for the next, as in a new process
    graphs = counters["stats"]["unique_graphs"]
    second = LLM(checkpoint, device="cpu", dtype="float32", **OFFLOADS[setting])
    assert _run(second) == resident_compiled[0]
    assert second._cpu_step.loaded == 1 and counters["stats"]["unique_graphs"] == graphs
    moved = second.transfer_stats()
    assert moved.num_compiled_steps == GREEDY.max_tokens - 1
    assert moved.weight_copied_bytes + moved.disk_read_bytes + moved.disk_mapped_bytes > 0


def test_two_offloaded_llms_side_by_side_keep_a_step_each(checkpoint, resident_compiled, compiles):
    """A compiled step holds its offloader's id as a constant: a second offloaded LLM of
    the same model and setting, alive beside the first, has another id and so its own kept
    step (the first's would wait on the first's slots)."""
    gc.collect()
    first = LLM(checkpoint, device="cpu", dtype="float32", **OFFLOADS["prefetch"])
    second = LLM(checkpoint, device="cpu", dtype="float32", **OFFLOADS["prefetch"])
    for llm in (first, second, first):
        assert _run(llm) == resident_compiled[0]
    assert second._cpu_step.loaded == 0
    assert len(list(step_cache.folder().glob("*.pt2"))) == 2


def test_a_step_compiled_beside_a_live_compile_of_it_keeps_its_name(
    checkpoint, compiles, monkeypatch, tmp_path
):
    """dynamo keeps a graph in its traced function's globals by name while it lives; each
    LLM's step has globals of its own, so a second compile of the same step (nothing kept
    to load) while the first lives is named after its fingerprint too, and inductor's
    caches serve it (a `_2` name would miss them in every process that did not compile
    it twice) -- with the first's bits."""
    from torch._dynamo.utils import counters

    first = LLM(checkpoint, device="cpu", dtype="float32")
    expected = _run(first)
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "other"))  # (no kept step)
    hits = counters["aot_autograd"]["autograd_cache_hit"]
    second = LLM(checkpoint, device="cpu", dtype="float32")
    assert _run(second) == expected and second._cpu_step.loaded == 0
    assert counters["aot_autograd"]["autograd_cache_hit"] > hits
    names = {
        step._compiled._artifacts.backend_id
        for llm in (first, second)
        for step in llm._cpu_step._steps.values()
    }
    [kept] = step_cache.folder().glob("*.pt2")
    assert names == {f"__compiled_fn_{kept.stem}"}


def test_the_folder_keeps_the_most_recently_used_steps(tmp_path):
    """Old steps and marks go (every new version names its steps anew); other files
    stay."""
    for age, name in enumerate(["c.pt2", "b.traced", "a.pt2", "notes.txt"]):
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (1000 - age * 100, 1000 - age * 100))
    assert step_cache.load(tmp_path / "a.pt2") is None  # (not a step: nothing loads)
    step_cache.prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.traced", "c.pt2", "notes.txt"]
    os.utime(tmp_path / "b.traced", (10, 10))
    step_cache.prune(tmp_path, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt2", "notes.txt"]


def test_the_kept_steps_name_holds_what_the_trace_bakes_in(checkpoint, compiles):
    from offload.engine.graphs import DecodeStep

    llm = LLM(checkpoint, device="cpu", dtype="float32")
    model = llm.model
    cache = {"past_key_values": None}
    mask = torch.ones(1, 128, dtype=torch.long)
    positions = torch.zeros(1, 7, dtype=torch.long)

    def name() -> str:
        step = DecodeStep.__new__(DecodeStep)
        step._model, step._cache, step.mask = model, cache, mask
        step.input_ids = torch.zeros(1, 1, dtype=torch.long)
        step.position_ids, step.cache_position = positions[:, -1:], torch.zeros(1)
        return step_cache.fingerprint(step, "(1, 128)")

    before = name()
    assert name() == before  # the same model and setting: the same file
    model.config.rms_norm_eps *= 2  # a constant the graph holds
    assert name() != before
    model.config.rms_norm_eps /= 2
    assert name() == before
    torch.set_num_threads(torch.get_num_threads() + 1)  # the kernels' thread count
    try:
        assert name() != before
    finally:
        torch.set_num_threads(torch.get_num_threads() - 1)
    hook = model.model.layers[0].register_forward_pre_hook(lambda module, args: None)
    assert name() != before
    hook.remove()
    assert name() == before


def test_a_kept_step_computes_with_the_weights_it_is_given(
    checkpoint, compiles, tmp_path, monkeypatch
):
    """The kept step bakes in the model's shape and config, never its weights: another
    checkpoint of the same config loads it and gives what its own compile gives."""
    import shutil

    from safetensors.torch import load_file, save_file

    other = shutil.copytree(checkpoint, tmp_path / "other")
    [weights] = list(other.glob("*.safetensors"))
    noise = torch.Generator().manual_seed(1)
    tensors = {
        name: value + 0.05 * torch.randn(value.shape, generator=noise, dtype=value.dtype)
        for name, value in load_file(weights).items()
    }
    save_file(tensors, weights, metadata={"format": "pt"})
    first = _run(LLM(checkpoint, device="cpu", dtype="float32"))
    kept = LLM(other, device="cpu", dtype="float32")
    result = _run(kept)
    assert kept._cpu_step.loaded == 1 and result != first
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "empty"))
    own = LLM(other, device="cpu", dtype="float32")
    assert _run(own) == result and own._cpu_step.loaded == 0


@pytest.fixture(scope="module", params=["Q4_1", "Q5_K"])
def stored(request, tmp_path_factory):
    """A small model of weights kept as stored: int4 products (Q4_1) or q8 (Q5_K: int8
    with a float32 scale and offset per 32 inputs, whose one-row products a compiled step
    writes out as a loop)."""
    return zoo.save_gguf_type_llm(tmp_path_factory.mktemp(request.param), request.param)


def _offloads_of(stored) -> list[str]:
    """The offloaded settings a stored model's compiled test runs: one for each format (the
    float32 tests run every setting compiled; tests/model/test_gguf_types.py every
    format with every setting eagerly), so that each is compiled once. (`generate` runs
    the same steps as the server: `tests/llm/test_one_engine.py`.)"""
    return ["prefetch"] if stored.name.startswith("Q4_1") else ["disk"]


# -- the server's steps (rows.RowStep): a graph for a lone row, one for batches ----------

# (prompt, max_tokens): B leaves early, and C is prefilled (in chunks of 4 tokens) into the
# row beside A while A decodes alone.
SERVED = [([5, 9, 14, 3], 10), ([7, 3], 2), ([30, 2, 8, 11, 4, 6], 6), ([12], 5), ([9, 9, 9], 4)]


def _serve(llm, max_num_seqs=2):
    """All of `SERVED` queued at once (one schedule whatever the timing: rows join and
    leave, batches of 1 and 2 rows, several widths): each one's tokens and logprobs."""
    import queue

    serving = llm.serving(max_num_seqs)
    queues = [queue.Queue() for _ in SERVED]
    requests = [
        serving.prepare(None, ids, _served_params(tokens), out.put)
        for (ids, tokens), out in zip(SERVED, queues, strict=True)
    ]
    serving.core.submit_all(requests)
    results = []
    for out in queues:
        while not (item := out.get(timeout=600)).finished:
            assert not isinstance(item, BaseException), item
        completion = item.outputs[0]
        logprobs = [{t: lp.logprob for t, lp in step.items()} for step in completion.logprobs]
        results.append((completion.token_ids, logprobs))
    serving.close()
    return results


def test_cores_of_every_size_run_the_same_two_graphs(checkpoint, compiles):
    """`generate`'s cores (rows and length rounded per call) and a server's hold caches of
    other sizes: the cache's size is dynamic in the graphs, so after a lone row's and a
    batch's graph nothing compiles again but the server's packed step (prompts riding in
    its decode steps, `packed_step`), where the row-invariant products are built. (A kept
    step is named after the sizes it was compiled at: a second LLM loads it where its
    first call has them.)"""
    from torch._dynamo.utils import counters

    prompts = [{"prompt_token_ids": [5 + i, 9, 14, 3 + i]} for i in range(5)]
    llm = LLM(checkpoint, device="cpu", dtype="float32")
    _run(llm)  # a lone row, a core of 2 rows
    llm.generate(prompts[:3], GREEDY, use_tqdm=False)  # a batch, a core of 4 rows
    graphs, made = counters["stats"]["unique_graphs"], llm.transfer_stats().num_compiled_steps
    assert sorted(key[0] for key in llm._cpu_step._steps) == GRAPHS
    llm.generate(prompts, GREEDY, use_tqdm=False)  # 8 rows: every step compiled
    assert llm.transfer_stats().num_compiled_steps == made + GREEDY.max_tokens - 1
    _serve(llm, max_num_seqs=4)  # the server's core
    packed = int(row_dot.library() is not None)
    assert counters["stats"]["unique_graphs"] == graphs + packed
    assert (("packed",) in llm._cpu_step._steps) == bool(packed)
    assert llm.transfer_stats().num_compiled_steps > made + GREEDY.max_tokens - 1
    second = LLM(checkpoint, device="cpu", dtype="float32")
    _run(second)  # (the first call's sizes, as the first LLM's: its kept step's name)
    second.generate(prompts[:3], GREEDY, use_tqdm=False)
    second.generate(prompts, GREEDY, use_tqdm=False)
    assert second._cpu_step.loaded == len(GRAPHS)
    assert counters["stats"]["unique_graphs"] == graphs + packed


def _served_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=3, ignore_eos=True)


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory):
    """The served prompts on the resident model: compiled (its graphs counted), and eager."""
    from torch._dynamo.utils import counters

    from offload.engine.step_runner import StepRunner

    batches = []  # the rows of each decode step
    packed = []  # whether each turn that carried a chunk ran as the compiled packed step
    decode, packed_logits = StepRunner.decode, mixed_step.packed_logits
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(cpu_step.ENV, "wait")
        patch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path_factory.mktemp("served")))
        patch.setattr(cpu_linear, "PAYS_BYTES", 0)
        patch.setattr(
            StepRunner,
            "decode",
            lambda self, rows: (batches.append(len(rows)), decode(self, rows))[1],
        )

        def logits(*args):
            out = packed_logits(*args)
            packed.append(out is not None)
            return out

        patch.setattr(mixed_step, "packed_logits", logits)
        llm = LLM(checkpoint, device="cpu", dtype="float32", max_num_batched_tokens=4)
        graphs = counters["stats"]["unique_graphs"]
        compiled = _serve(llm)
        made = counters["stats"]["unique_graphs"] - graphs
        steps = llm.transfer_stats().num_compiled_steps
        # Every decode step compiled: of 2 rows, and of a lone row; and where the
        # row-invariant products are built, the turns in which a lone row decodes while a
        # group's prompt rides beside it, in chunks of 4 tokens (`packed_step`).
        assert 1 in batches and 2 in batches and steps == len(batches) + sum(packed)
        assert all(packed) and bool(packed) == (GRAPHS == ["rows"])
        # (the same schedule: a prompt prefilled in chunks beside a decoding row moves that
        # row's last bits, compiled or not)
        eager_llm = LLM(
            checkpoint, device="cpu", dtype="float32", max_num_batched_tokens=4, enforce_eager=True
        )
        eager = _serve(eager_llm)
        assert eager_llm.transfer_stats().num_compiled_steps == 0
    return compiled, eager, made, (steps, sum(packed)), llm  # (steps: of them, packed)


def test_served_steps_run_each_compiled_graph_once(served):
    *_, made, _, llm = served
    graphs = sorted(GRAPHS + (["packed"] if GRAPHS == ["rows"] else []))  # (and packed steps)
    assert made == len(graphs) and sorted(key[0] for key in llm._cpu_step._steps) == graphs
    assert list(llm._cpu_step.graphs.values()) == [1] * len(graphs)


def test_the_served_compiled_step_gives_the_eager_steps_bits(served):
    compiled, eager, *_ = served
    assert compiled == eager


# (UVA and prefetch run the same core's steps under generate's test above; the batches'
# graph over weights streamed from disk, and over the KV offloader below, are these.)
@pytest.mark.parametrize("setting", ["disk"])
def test_served_compiled_batches_offloaded_equal_them_resident_bitwise(
    checkpoint, served, compiles, setting
):
    llm = LLM(
        checkpoint, device="cpu", dtype="float32", max_num_batched_tokens=4, **OFFLOADS[setting]
    )
    assert _serve(llm) == served[0]
    assert llm.transfer_stats().num_compiled_steps == served[3][0]
    moved = llm.transfer_stats()
    assert llm.offloader.offloaded_bytes > 0
    streamed = moved.weight_copied_bytes + moved.disk_read_bytes + moved.disk_mapped_bytes
    assert streamed > 0 or setting == "uva"  # (UVA reads in place on a CPU)


def test_served_compiled_steps_with_the_kv_cache_in_host_memory_give_its_device_bits(
    checkpoint, served, compiles
):
    """KV offload on the engine core (`row_kv`): the compiled steps of its own (a lone
    row's and the batches'), every decode step compiled, the resident server's bits."""
    llm = LLM(checkpoint, device="cpu", dtype="float32", max_num_batched_tokens=4, kv_offload=True)
    assert _serve(llm) == served[0]
    # (no packed step: the turns that carry a chunk run eagerly over host memory's rows)
    assert llm.transfer_stats().num_compiled_steps == served[3][0] - served[3][1]
    assert {(key[0], key[1]) for key in llm._cpu_step._steps} == {
        (graph, "kv offload") for graph in GRAPHS
    }


def test_a_warmed_up_server_keeps_its_step_and_the_next_one_loads_it(checkpoint, served, compiles):
    """`warm_up` compiles the step before any request (what `offload serve` does before it
    listens) and keeps it on disk; the next server of the same model loads it (no trace)
    and serves the same bits."""
    from torch._dynamo.utils import counters

    first = LLM(checkpoint, device="cpu", dtype="float32", max_num_batched_tokens=4)
    serving = first.serving(2)
    rows = serving.core.runner.cache
    for layer in rows.cache.layers:  # (marked, to see what the warm-up writes)
        layer.all_keys.fill_(float("nan"))
    serving.warm_up()  # (and the packed step's graph, where the products are built)
    graphs = sorted(GRAPHS + (["packed"] if GRAPHS == ["rows"] else []))
    assert sorted(key[0] for key in first._cpu_step._steps) == graphs
    assert first._cpu_step.loaded == 0
    # Its padding rows wrote only the column past max_len, which no row reads (the first
    # layer's keys there are the tokens' own; the later ones' come from what the marks gave).
    layers = rows.cache.layers
    assert not layers[0].all_keys[:2, :, rows.max_len].isnan().any()
    for layer in layers:
        assert layer.all_keys[:, :, : rows.max_len].isnan().all()
        layer.all_keys.zero_()
    assert _serve(first) == served[0]
    made = counters["stats"]["unique_graphs"]
    second = LLM(checkpoint, device="cpu", dtype="float32", max_num_batched_tokens=4)
    second.serving(2).warm_up()
    assert second._cpu_step.loaded == len(graphs) and counters["stats"]["unique_graphs"] == made
    assert _serve(second) == served[0]
    assert second.transfer_stats().num_compiled_steps == served[3][0]


def test_a_stored_models_served_steps_compile_and_offloaded_give_their_resident_bits(
    stored, compiles, monkeypatch
):
    """Weights kept as stored (their products opaque ops, the rest of the step fused):
    the server's lone rows and batches run compiled, tokens as eager's, and offloaded
    (prefetch, the disk tier) give the resident bits."""

    from offload.engine.step_runner import StepRunner

    batches = []  # the rows of each decode step
    packed = []  # whether each turn that carried a chunk ran as the compiled packed step
    decode, packed_logits = StepRunner.decode, mixed_step.packed_logits

    def serve(**settings):
        llm = LLM(stored, device="cpu", max_num_batched_tokens=4, **settings)
        return _serve(llm), llm.transfer_stats()

    # (as the default model's: no float32 linear to speak of, `cpu_linear.pays` false)
    monkeypatch.setattr(cpu_linear, "PAYS_BYTES", 1)
    assert cpu_step.pays(LLM(stored, device="cpu", enforce_eager=True).model)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            StepRunner,
            "decode",
            lambda self, rows: (batches.append(len(rows)), decode(self, rows))[1],
        )

        def logits(*args):
            out = packed_logits(*args)
            packed.append(out is not None)
            return out

        patch.setattr(mixed_step, "packed_logits", logits)
        expected, moved = serve()
    assert 1 in batches and 2 in batches and all(packed)
    assert moved.num_compiled_steps == len(batches) + sum(packed)
    eager, _ = serve(enforce_eager=True)
    assert expected == eager  # (tokens and logprobs: `engine/step_order`)
    for setting in _offloads_of(stored):
        result, moved = serve(**OFFLOADS[setting])
        assert result == expected, setting
        assert moved.weight_copied_bytes + moved.disk_read_bytes + moved.disk_mapped_bytes > 0
