"""Start-up in seconds (issue 50): the first `offload serve` of a model on a machine answers
at once, eagerly, while its CPU decode steps compile in the background and are kept; the
second launch of the same command answers `/health` within seconds and loads them: dynamo
traces nothing in that process, and its decode steps run compiled."""

import time

import pytest
import zoo
from http_server import KEY, Server, http

from offload.quant import row_dot

pytestmark = pytest.mark.slow
GRAPHS = 2 if row_dot.library() is not None else 1  # the kept steps of a warm-up


def _total(server, name: str) -> float:
    for line in http(server.url + "/metrics")[1].splitlines():
        if line.startswith(name + "{"):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} in /metrics")


def _until(what, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)


def _ask(server) -> None:
    server.client().completions.create(model="tiny", prompt="t3 t4", max_tokens=4)


def test_a_second_launch_loads_the_kept_steps_and_compiles_nothing(tmp_path, monkeypatch):
    # (a stored model whose compiled step pays: 2 layers of SmolLM2's width in Q4_0)
    checkpoint = zoo.save_q4_0_shape(tmp_path / "model", layers=2)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(cache))
    monkeypatch.setenv("OFFLOAD_CPU_COMPILE", "1")  # (the suite's default is 0)
    flags = ("--api-key", KEY, "--max-num-seqs", "4", "--max-model-len", "256")
    first = Server(checkpoint, *flags)
    try:
        _ask(first)  # (answered while its steps compile)
        assert _total(first, "offload:step_jobs_pending") == 1
        steps = cache / "compiled-steps"
        # (one graph for every row count: a lone row runs beside a padding row; and the
        # packed step's, prompts riding in decode steps, where the products are built)
        _until(lambda: len(list(steps.glob("*.pt2"))) == GRAPHS, 300)
        _until(lambda: (_ask(first), _total(first, "offload:compiled_steps_total"))[1] > 0, 120)
        assert _total(first, "offload:dynamo_graphs_compiled_total") >= 1
    finally:
        first.stop()
    started = time.monotonic()
    second = Server(checkpoint, *flags)
    try:
        ready_s = time.monotonic() - started
        assert ready_s < 15, ready_s
        _until(lambda: (_ask(second), _total(second, "offload:compiled_steps_total"))[1] > 0, 60)
        assert _total(second, "offload:dynamo_graphs_compiled_total") == 0
        _until(lambda: _total(second, "offload:step_jobs_pending") == 0, 60)  # (all loaded)
    finally:
        second.stop()
