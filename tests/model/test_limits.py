"""Configs with absurd sizes are one ModelError line in well under a second, before
transformers builds anything; configs at the limits and the shipped ones still build."""

import json
import subprocess
import sys
import time

import pytest

from offload import LLM, ModelError
from offload.model import limits
from offload.model.build import build_empty

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}


def _config(folder, **changes):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**TINY, **changes}))
    return folder


@pytest.fixture(scope="module", autouse=True)
def _warm(tmp_path_factory):
    """The first build imports transformers' model code: not part of what is timed."""
    build_empty(_config(tmp_path_factory.mktemp("warm") / "tiny"), "auto")


def _refused_fast(call, *needles):
    started = time.perf_counter()
    with pytest.raises(ModelError) as info:
        call()
    elapsed = time.perf_counter() - started
    message = str(info.value)
    assert elapsed < 1, f"{elapsed:.1f} s"
    assert "\n" not in message and all(n in message for n in needles), message
    return message


ABSURD = [
    ({"num_hidden_layers": 10**9}, "num_hidden_layers=1000000000", "4096"),
    ({"num_hidden_layers": 10**6}, "num_hidden_layers=1000000", "4096"),
    ({"num_hidden_layers": 1e300}, "num_hidden_layers=1e+300", "4096"),
    ({"hidden_size": 10**7}, "hidden_size=10000000", "1048576"),
    ({"intermediate_size": 10**9}, "intermediate_size=1000000000", "4194304"),
    ({"vocab_size": 10**9}, "vocab_size=1000000000", "16777216"),
    ({"vocab_size": 2**70}, f"vocab_size={2**70}", "16777216"),
    ({"num_attention_heads": 10**6}, "num_attention_heads=1000000", "65536"),
    ({"max_position_embeddings": 10**12}, "max_position_embeddings=1000000000000", "16777216"),
    ({"num_local_experts": 10**6}, "num_local_experts=1000000", "8192"),
    ({"model_type": "gpt2", "n_layer": 10**9}, "n_layer=1000000000", "4096"),
    ({"text_config": {"num_hidden_layers": 10**9}}, "num_hidden_layers=1000000000", "4096"),
]


@pytest.mark.parametrize(
    ("changes", "field", "limit"),
    ABSURD,
    ids=[f"{'nested-' if 'text_config' in a[0] else ''}{a[1]}" for a in ABSURD],
)
def test_absurd_sizes_are_refused_at_once(tmp_path, changes, field, limit):
    path = _config(tmp_path / "absurd", **changes)
    message = _refused_fast(lambda: build_empty(path, "auto"), field, limit)
    assert message.startswith(f"{path / 'config.json'}: ")


def test_too_many_parameters_are_refused_at_once(tmp_path):
    # Every size within its limit, but together about 5.5e14 parameters.
    path = _config(tmp_path / "huge", num_hidden_layers=4000, hidden_size=1 << 18)
    _refused_fast(
        lambda: build_empty(path, "auto"),
        "num_hidden_layers=4000, hidden_size=262144",
        "5.5e+14 parameters",
        "limit of 1e+13",
    )


def test_llm_refuses_before_anything_else(tmp_path):
    path = _config(tmp_path / "deep", num_hidden_layers=10**9)
    _refused_fast(lambda: LLM(path), "num_hidden_layers=1000000000")


def test_inspect_is_one_line(tmp_path):
    path = _config(tmp_path / "deep", num_hidden_layers=10**6)
    result = subprocess.run(
        [sys.executable, "-m", "offload.cli", "inspect", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"offload: error: {path / 'config.json'}: num_hidden_layers=1000000 is too large "
        "(the limit for layers is 4096)"
    ]


def test_sizes_at_the_limits_still_build(tmp_path):
    path = _config(
        tmp_path / "wide",
        vocab_size=limits.MAX_VOCAB,
        max_position_embeddings=limits.MAX_POSITIONS,
        num_hidden_layers=64,
    )
    model = build_empty(path, "auto")
    assert model.config.vocab_size == limits.MAX_VOCAB
    assert len(model.model.layers) == 64
