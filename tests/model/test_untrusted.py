"""A checkpoint's own Python code (its `auto_map`) never runs unless trust_remote_code=True:
not on loading, not on a `[y/N]` question on stdin, not from the CLI."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zoo
from transformers import PreTrainedTokenizerFast

from offload import LLM, ModelError, SamplingParams
from offload.model.build import build_empty
from offload.model.loader import load_model
from offload.model.tokenizer import load_tokenizer

# Each module of the checkpoint's code leaves a marker file when it is imported.
CONFIG_CODE = """
from pathlib import Path
Path({marker!r}).touch()
from transformers import LlamaConfig
class EvilConfig(LlamaConfig):
    model_type = "evil"
"""
MODEL_CODE = """
from pathlib import Path
Path({marker!r}).touch()
from transformers import LlamaForCausalLM
from .configuration_evil import EvilConfig
class EvilForCausalLM(LlamaForCausalLM):
    config_class = EvilConfig
"""
TOKENIZER_CODE = """
from pathlib import Path
Path({marker!r}).touch()
from transformers import PreTrainedTokenizerFast
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""
AUTO_MAP = {
    "AutoConfig": "configuration_evil.EvilConfig",
    "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
}


def _checkpoint(folder: Path, model_type: str, evil_tokenizer: bool = False) -> Path:
    """A tiny Llama checkpoint whose config and tokenizer name code of their own."""
    zoo.build("llama", num_layers=2).save_pretrained(folder)
    zoo._word_tokenizer(zoo.VOCAB).save_pretrained(folder)
    marker = str(folder.parent / "MARKER")
    for name, code in [
        ("configuration_evil.py", CONFIG_CODE),
        ("modeling_evil.py", MODEL_CODE),
        ("tokenization_evil.py", TOKENIZER_CODE),
    ]:
        (folder / name).write_text(code.format(marker=marker))
    _edit(folder / "config.json", model_type=model_type, auto_map=AUTO_MAP)
    auto_map = {"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]}
    if evil_tokenizer:
        _edit(folder / "tokenizer_config.json", tokenizer_class="EvilTokenizer", auto_map=auto_map)
    else:  # names its code, but as a class transformers has
        _edit(folder / "tokenizer_config.json", auto_map=auto_map)
    return folder


def _edit(path: Path, **changes):
    settings = json.loads(path.read_text())
    settings.update(changes)
    path.write_text(json.dumps(settings))


@pytest.fixture
def unknown_type(tmp_path):
    return _checkpoint(tmp_path / "evil", "evil", evil_tokenizer=True)


@pytest.fixture
def known_type(tmp_path):
    return _checkpoint(tmp_path / "llama-with-code", "llama")


@pytest.fixture(autouse=True)
def questions(monkeypatch):
    """What transformers asks on stdin (answered "n"): it must ask nothing. A question
    that raised would be swallowed by the loader's error handling, hence the record."""
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "n")
    yield asked
    assert asked == []


def _marker(path: Path) -> Path:
    return path.parent / "MARKER"


def _one_line_own_code_error(info, path: Path):
    message = str(info.value)
    assert "\n" not in message
    assert "own Python code" in message and "trust_remote_code=True" in message, message
    assert not _marker(path).exists()


def test_build_empty_refuses_an_unknown_type_with_code(unknown_type):
    with pytest.raises(ModelError) as info:
        build_empty(unknown_type, "auto")
    _one_line_own_code_error(info, unknown_type)
    assert 'model_type "evil"' in str(info.value)


def test_load_tokenizer_refuses_a_tokenizer_with_code(unknown_type):
    with pytest.raises(ModelError) as info:
        load_tokenizer(unknown_type)
    _one_line_own_code_error(info, unknown_type)
    assert "AutoTokenizer" in str(info.value)


def test_llm_refuses_an_unknown_type_with_code(unknown_type):
    with pytest.raises(ModelError) as info:
        LLM(unknown_type)
    _one_line_own_code_error(info, unknown_type)


def test_known_type_loads_the_built_in_classes(known_type):
    assert type(build_empty(known_type, "auto")).__name__ == "LlamaForCausalLM"
    assert isinstance(load_tokenizer(known_type), PreTrainedTokenizerFast)
    model, _ = load_model(known_type)
    assert type(model).__name__ == "LlamaForCausalLM"
    llm = LLM(known_type)
    [out] = llm.generate("t5 t6 t7", SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 3
    assert not _marker(known_type).exists()


def _cli(*argv, modules_cache: Path, stdin: str = "y\n"):
    # A trusted run imports the checkpoint's code from transformers' modules cache: in
    # tmp_path, not the user's.
    env = {**os.environ, "HF_MODULES_CACHE": str(modules_cache)}
    return subprocess.run(
        [sys.executable, "-m", "offload.cli", *argv],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.mark.parametrize(
    ("command", "model_type", "evil_tokenizer"),
    [("generate", "evil", True), ("inspect", "evil", True), ("generate", "llama", True)],
    ids=["generate", "inspect", "generate-own-tokenizer"],
)
def test_cli_answers_no_question_and_runs_no_code(tmp_path, command, model_type, evil_tokenizer):
    path = _checkpoint(tmp_path / "evil", model_type, evil_tokenizer)
    argv = ["generate", "--model", str(path), "--no-progress", "--max-tokens", "2"]
    if command == "inspect":
        argv = ["inspect", str(path)]
    result = _cli(*argv, modules_cache=tmp_path / "modules")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "[y/N]" not in result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("offload: error: "), result.stderr
    assert "trust_remote_code=True" in lines[0]
    assert not _marker(path).exists()


def test_cli_trust_remote_code_runs_the_code_and_says_so(unknown_type, tmp_path):
    # The same checkpoint with the flag: its code is imported, and the figures line says so.
    argv = ["generate", "--model", str(unknown_type), "--no-progress", "--max-tokens", "2"]
    result = _cli(*argv, "--trust-remote-code", modules_cache=tmp_path / "modules")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].endswith("; trust_remote_code=True]"), result.stdout
    assert _marker(unknown_type).exists()
