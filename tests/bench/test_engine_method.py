"""`offload bench`'s engine rows with speculation (`llm-ngram`, `llm-draft`): the engine's
tokens, each turn's time shared by the tokens it gave, and a draft that cannot be had
skipped with why."""

import pytest
from small_probes import SMALL_PROBES

from offload.bench import Workload, run_bench
from offload.bench.engine import _spread


def test_a_turn_s_time_is_shared_by_its_tokens():
    assert _spread([0.3, 0.0, 0.0, 0.1]) == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert _spread([0.2, 0.4]) == [0.2, 0.4]  # (one token a turn: as measured)
    assert _spread([]) == []


def test_the_speculating_rows_give_the_engine_s_tokens(tiny_llama_path):
    workload = Workload(
        model=str(tiny_llama_path), device="cpu", batch_sizes=(1,), prompt_len=4,
        output_len=24, rounds=1,
    )  # fmt: skip
    result = run_bench(
        workload, ["llm", "llm-ngram", "llm-draft"], progress=False, settings=SMALL_PROBES
    )
    rows = {row.method: row for row in result.records}
    assert set(rows) == {"llm", "llm-ngram"}
    assert rows["llm-ngram"].same_tokens is True
    assert rows["llm-ngram"].setting == {"speculative_config": {"method": "ngram"}}
    assert "not made from a GGUF" in result.skipped["llm-draft"]
