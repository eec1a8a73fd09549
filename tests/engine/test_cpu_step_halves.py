"""The compiled CPU decode step of a bfloat16 or float16 checkpoint (engine/step_linears.py):
it compiles with its products written out, and offloaded it gives the resident step's bits."""

import pytest
import torch
from compiling import graphs_compiled_anew
from streams import check_invariant, random_prompts
from torch._dynamo.utils import counters

from offload import SamplingParams
from offload.engine import cpu_linear
from offload.llm.llm import LLM
from offload.quant import row_dot
from tests import zoo
from tests.engine.test_cpu_step import (  # noqa: F401 (`compiles`: a fixture)
    GREEDY,
    LONE,
    OFFLOADS,
    _run,
    _run_batch,
    compiles,
)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

NUM_LAYERS = 2
PRODUCTS = NUM_LAYERS * 7 + 1  # a Llama layer's q, k, v, o, gate, up, down; the head


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def halves(request, tmp_path_factory):
    """A tiny checkpoint stored in bfloat16 or float16 (`dtype="auto"` runs it so)."""
    folder = tmp_path_factory.mktemp(str(request.param).removeprefix("torch."))
    return zoo.save_attentive_llm(folder, num_layers=NUM_LAYERS, dtype=request.param)


def _rows_run(llm, rows: int) -> list:
    """(tokens, logprobs) of each sequence of a greedy run of one row, or of two."""
    return [_run(llm)] if rows == 1 else _run_batch(llm)


def _compiled_runs(llm, batches: tuple[int, ...], count=False) -> tuple[list, object]:
    """`_rows_run` of each row count in `batches`, each compiled (`count`: each compile's
    products written out, counted: only where inductor's caches are off, else a compile
    may be a cache hit, which runs no pass); and what the runs moved."""
    results, graphs = [], set()
    for rows in batches:
        before = counters["offload"]["products_rewritten"]
        results.append(_rows_run(llm, rows))
        graph = LONE if rows == 1 else "rows"  # (with the row-invariant products a lone
        if count:  # row runs in the batches' graph: compiled once for both)
            made = PRODUCTS if graph not in graphs else 0
            assert counters["offload"]["products_rewritten"] - before == made
        graphs.add(graph)
    moved = llm.transfer_stats()
    assert moved.num_compiled_steps == len(batches) * (GREEDY.max_tokens - 1)
    return results, moved


# (bf16: every setting at one row, the disk tier's batch too; fp16 a batch. Their products:
# `quant/row_dot` where built, else oneDNN's bf16 and fp16 each slice widened to float32)
SETTINGS = {torch.bfloat16: {"prefetch": (1,), "disk": (1, 2)}, torch.float16: {"disk": (2,)}}


@pytest.mark.usefixtures("compiles")
def test_a_halves_model_compiles_and_offloaded_gives_the_resident_bits(halves, monkeypatch):
    monkeypatch.setattr(cpu_linear, "UPCAST_MIN_ROWS", 2)  # (where fp16 widens: every batch)
    resident = LLM(halves, device="cpu")
    settings = SETTINGS[resident.model.get_input_embeddings().weight.dtype]
    batches = tuple(sorted({rows for each in settings.values() for rows in each}))
    with graphs_compiled_anew():
        expected, _ = _compiled_runs(resident, batches, count=True)
    # The eager step's bits: tokens and logprobs (`engine/step_order`).
    eager = LLM(halves, device="cpu", enforce_eager=True)
    assert expected == [_rows_run(eager, rows) for rows in batches]
    for setting, rows in settings.items():
        llm = LLM(halves, device="cpu", **OFFLOADS[setting])
        result, moved = _compiled_runs(llm, rows)
        assert result == [expected[batches.index(n)] for n in rows], setting
        assert moved.weight_copied_bytes + moved.disk_read_bytes + moved.disk_mapped_bytes > 0


@pytest.mark.usefixtures("compiles")
def test_a_halves_model_compiled_answers_alike_alone_and_in_any_batch(halves):
    """bf16 and fp16 compiled steps with the row-invariant products (`quant/row_dot`): a
    prompt's tokens and logprobs alone and beside any others, bit for bit."""
    if row_dot.library() is None:
        pytest.skip("no C compiler here: the row-invariant products are not built")
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    with LLM(halves, device="cpu", max_model_len=128, enable_prefix_caching=False) as llm:
        prompts = random_prompts(llm.model.config.vocab_size, (1, 3, 9, 30, 70), seed=4)
        check_invariant(llm, prompts, params)
        assert set(llm._cpu_step.graphs) == {("rows",)}
