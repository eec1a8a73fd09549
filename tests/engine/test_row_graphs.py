"""The engine core's decode steps as graphs (`engine/row_graphs.py`), on a CPU: a stand-in
graph maker whose replay runs the captured step again on the tensors it was captured
with, as a CUDA graph replays its kernels on the same addresses. What it checks is ours —
rows padded to a power of two, one graph per (rows, width), each step's inputs copied into
its graph's, the logits those of the step asked for, every replay counted; that CUDA
captures and replays the same work is tests/cuda's to check."""

import pytest

from offload import SamplingParams
from offload.engine.row_graphs import RowGraphs
from offload.engine.transfer_stats import TransferStats
from offload.llm import cores
from offload.llm.llm import LLM
from offload.quant import row_dot
from tests import zoo

GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
# Three prompts of different lengths, and a fourth as long as the shortest.
PROMPTS = [[5, 9, 14, 3, 27, 8, 11], [4, 6], [7, 7, 30, 2, 19], [12, 13]]


class RerunMaker:
    """A graph that is its step: a replay runs the step again and writes its logits into
    the tensor the capture returned (as a CUDA graph writes into its static output)."""

    captures = 0

    def __init__(self, offloader):
        self.offloader = offloader
        self.logits = {}

    def capture(self, step, pool):
        RerunMaker.captures += 1
        self.logits[id(step)] = step().clone()
        return step, self.logits[id(step)]

    def replay(self, graph):
        self.logits[id(graph)].copy_(graph())

    def pool(self, graph):
        return None


@pytest.fixture(autouse=True)
def _blas_forms(monkeypatch):
    """CUDA graphs run on GPUs, where the CPU's row-invariant products never run; the
    emulation here replays bare steps, so its eager reference takes no CPU kernel either."""
    monkeypatch.setattr(row_dot, "library", lambda: None)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return zoo.save_attentive_llm(tmp_path_factory.mktemp("row-graphs"), num_layers=2)


def _answers(outputs):
    return [
        (c.token_ids, [{t: lp.logprob for t, lp in e.items()} for e in c.logprobs])
        for o in outputs
        for c in o.outputs
    ]


def _generate(llm, prompts):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


def test_rows_are_rounded_up_to_a_power_of_two_within_the_cache():
    graphs = RowGraphs(RerunMaker(None), held_rows=6, counters=TransferStats)
    assert [graphs.rows_for(n) for n in (1, 2, 3, 4, 5, 6)] == [1, 2, 4, 4, 6, 6]


def test_graph_steps_give_the_eager_steps_bits_over_padded_rows(checkpoint, monkeypatch):
    with LLM(checkpoint, device="cpu", dtype="float32") as eager:
        # Four rows: three prompts and one as long as the shortest (its row stands where
        # the graphs' padding row stands; rows never mix in a product).
        expected = _answers(_generate(eager, PROMPTS))[:3]
        alone_expected = _answers(_generate(eager, PROMPTS[:1]))  # (a lone row's kernels)
    monkeypatch.setattr(cores, "CudaGraphMaker", RerunMaker)
    RerunMaker.captures = 0
    with LLM(checkpoint, device="cpu", dtype="float32", offload_group_size=1) as llm:
        llm._use_graphs = True  # (as on a GPU without enforce_eager)
        before = llm.transfer_stats()
        got = _answers(_generate(llm, PROMPTS[:3]))
        moved = llm.transfer_stats() - before
        graphs = llm._generator.core.runner.graphs
        assert got == expected
        # Seven decode steps (the first token is the prefill's) over 3 rows padded to 4, of
        # one read width: one graph, replayed at every step.
        assert graphs.num_graphs == RerunMaker.captures == 1
        assert moved.num_graph_replays == GREEDY.max_tokens - 1
        # A second call replays the same graph, and gives the same answers.
        assert _answers(_generate(llm, PROMPTS[:3])) == expected
        assert RerunMaker.captures == 1
        # One prompt alone: a graph of one row of its own.
        assert _answers(_generate(llm, PROMPTS[:1])) == alone_expected
        assert graphs.num_graphs == 2


def test_each_read_width_has_its_graph_and_the_answer_crosses_them(checkpoint, monkeypatch):
    long = SamplingParams(temperature=0, max_tokens=70, logprobs=1, ignore_eos=True)
    prompt = [{"prompt_token_ids": PROMPTS[0]}]
    with LLM(checkpoint, device="cpu", dtype="float32") as eager:
        expected = _answers(eager.generate(prompt, long, use_tqdm=False))
    monkeypatch.setattr(cores, "CudaGraphMaker", RerunMaker)
    with LLM(checkpoint, device="cpu", dtype="float32") as llm:
        llm._use_graphs = True
        assert _answers(llm.generate(prompt, long, use_tqdm=False)) == expected
        # 7 + 70 columns: widths 64 and 128
        assert llm._generator.core.runner.graphs.num_graphs == 2


def test_no_graphs_with_the_kv_cache_in_host_memory(checkpoint, monkeypatch):
    monkeypatch.setattr(cores, "CudaGraphMaker", RerunMaker)
    with LLM(checkpoint, device="cpu", dtype="float32", kv_offload=True) as llm:
        llm._use_graphs = True
        _generate(llm, PROMPTS[:1])
        assert llm._generator.core.runner.graphs is None
        assert llm.transfer_stats().num_graph_replays == 0


def test_a_step_refills_its_graphs_inputs(checkpoint, monkeypatch):
    """Two calls whose prompts differ replay one graph: the second call's answers are
    its own (its tokens and columns copied into the captured step's tensors)."""
    monkeypatch.setattr(cores, "CudaGraphMaker", RerunMaker)
    with LLM(checkpoint, device="cpu", dtype="float32") as eager:
        first, second = (_answers(_generate(eager, [p])) for p in PROMPTS[:2])
    with LLM(checkpoint, device="cpu", dtype="float32") as llm:
        llm._use_graphs = True
        assert _answers(_generate(llm, [PROMPTS[0]])) == first
        assert _answers(_generate(llm, [PROMPTS[1]])) == second
        assert llm._generator.core.runner.graphs.num_graphs == 1
