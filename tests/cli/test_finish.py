"""What a new user meets in the `offload` command: --version, help for every flag with its
default, labelled answers, text streamed as it is generated, and `inspect` of the
default model against a device budget."""

from __future__ import annotations

import argparse
import io
from importlib import metadata

import pytest
import zoo
from hypothesis import given
from hypothesis import strategies as st

from offload.cli import build_parser, commands, main
from offload.engine.sampling import find_stop
from offload.llm.streaming import TextStream, settled
from offload.quant.layouts import packing_of


def _subparsers(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"offload {metadata.version('offload')}"


def test_every_flag_has_help_and_its_default_is_shown():
    """A flag that takes a value says its default: argparse's "(default: X)", 0 included,
    or where it is None what leaving it out does. A switch is off unless given."""
    parser = build_parser()
    for name, sub in _subparsers(parser):
        text = " ".join(sub.format_help().split())
        formatter = sub._get_formatter()
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = f"{name} {action.option_strings or action.dest}"
            assert action.help, f"{flag} has no help"
            if not action.option_strings or action.nargs == 0:
                continue
            if action.default is not None:
                assert f"(default: {action.default})" in text, f"{flag}: default not shown"
            assert "default" in formatter._expand_help(action), f"{flag}: default not said"
    generate = dict(_subparsers(parser))["generate"].format_help()
    assert "(default: auto)" in generate and "--no-stream" in generate


class _Recorder(io.StringIO):
    """An output that remembers each write (a stream writes the answer in pieces)."""

    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, text):
        self.writes.append(text)
        return super().write(text)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return zoo.save_tiny_llm(tmp_path_factory.mktemp("tiny"), num_layers=2)


def _generate(*argv):
    out = _Recorder()
    commands.generate(build_parser().parse_args(["generate", *argv]), out)
    return out


def _one_prompt(model):
    return [
        "--model",
        str(model),
        "--prompt",
        "t5 t6 t7 t8",
        "--max-tokens",
        "12",
        "--device",
        "cpu",
    ]


def test_one_answer_streams_and_equals_the_unstreamed_answer(tiny):
    argv = _one_prompt(tiny)
    streamed, whole = _generate(*argv), _generate(*argv, "--no-stream")
    answer = whole.getvalue().split("\n[")[0]
    assert streamed.getvalue().split("\n[")[0] == answer and answer.strip()
    # Written piece by piece as tokens came, not once at the end.
    assert len([w for w in streamed.writes if w.strip()]) > 2
    assert len([w for w in whole.writes if w.strip()]) == 2  # the answer, then the figures
    assert " on cpu: " in streamed.getvalue().splitlines()[-1]


def test_a_stop_string_is_never_streamed(tiny):
    argv = _one_prompt(tiny)
    free = _generate(*argv, "--no-stream").getvalue().split("\n[")[0]
    words = free.split()
    assert len(words) > 3
    stop = " ".join(words[2:4])  # two words the free answer has
    streamed = _generate(*argv, "--stop", stop).getvalue().split("\n[")[0]
    assert streamed == free[: free.index(stop)]
    assert stop not in streamed


def test_several_answers_are_labelled(tiny):
    argv = ["--model", str(tiny), "--prompt", "t5 t6", "--prompt", "t7 t8", "--max-tokens", "4"]
    lines = _generate(*argv).getvalue().splitlines()
    assert lines[0] == "--- prompt 1: t5 t6"
    assert "--- prompt 2: t7 t8" in lines
    assert lines[-1].startswith("[") and lines[-1].endswith("]")


@given(
    st.text(alphabet="ab \ufffd", max_size=24),
    st.lists(st.text(alphabet="ab ", min_size=1, max_size=3), max_size=2),
)
def test_streamed_text_is_always_a_prefix_of_the_final_text(raw, stops):
    """Replay a generation: at each step the engine's text is the raw text so far, cut
    at the first stop string; the stream must never show what the final text lacks."""
    shown = []
    stream = TextStream(shown.append, stops)
    final = raw
    for end in range(len(raw) + 1):
        found = find_stop(raw[:end], stops)
        if found is not None:
            final = found[0]
            break
        if "\ufffd" in raw[:end].rstrip("\ufffd"):
            continue  # an earlier replacement character stays; only a trailing one heals
        stream.update(raw[:end])
    if "\ufffd" in final:
        return
    stream.finish(final)
    assert "".join(shown) == final


def test_settled_holds_back_what_may_still_change():
    assert settled("Paris is", ["is the"]) == "Paris"  # "is" may begin the stop string
    assert settled("caf\ufffd", []) == "caf"  # an incomplete UTF-8 character
    assert settled("Hello ", []) == "Hello"  # a space a clean-up may merge
    assert settled("Hello world", ["xyz"]) == "Hello world"


def test_inspect_without_a_path_is_the_default_model_against_a_budget(capsys, smollm2_path):
    argv = ["inspect", "--device", "cpu", "--device-memory-gb", "0.3", "--max-model-len", "512"]
    # As stored (the default on a CPU): 92 MiB of weights fit the budget as they are.
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f".Q4_1.stored-{packing_of('cpu')}-" in out.splitlines()[0]
    assert "92.1 MiB of parameters (GGUF Q4_1, Q8_0 as stored, computing in float32)" in out
    assert "fits the cpu budget 276.5 MiB (max_model_len 512) without offloading" in out
    # The float32 conversion does not.
    argv = [*argv, "--dtype", "float32"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{smollm2_path}: LlamaForCausalLM")
    assert "does not fit the cpu budget 276.5 MiB (max_model_len 512)" in out
    assert "--cpu-offload-gb 0.33" in out
    assert main([*argv, "--cpu-offload-gb", "0.33"]) == 0
    assert "fits the cpu budget 276.5 MiB (max_model_len 512) with this offloading" in (
        capsys.readouterr().out
    )


def test_the_disk_tier_flags_stream_and_the_figures_say_so(tmp_path):
    # More layers than the 2 slots of read-ahead 1: every forward reads from disk.
    argv = [*_one_prompt(zoo.save_tiny_llm(tmp_path, num_layers=5)), "--no-stream"]
    resident = _generate(*argv).getvalue()
    disk = ["--cpu-memory-gb", "0", "--read-ahead", "1"]
    streamed = _generate(*argv, *disk, "--disk-io", "direct").getvalue()
    assert streamed.split("\n[")[0] == resident.split("\n[")[0]
    figures = streamed.splitlines()[-1]
    assert "/forward from disk at " in figures and "I/O stall" in figures
    assert "from disk" not in resident and "mapped" not in figures
    zoo.realign(tmp_path)  # (a mapping needs aligned weights)
    mapped = _generate(*argv, *disk, "--disk-io", "mmap").getvalue()
    assert mapped.split("\n[")[0] == resident.split("\n[")[0]
    figures = mapped.splitlines()[-1]
    assert "/forward of mapped checkpoint files" in figures and "from disk" not in figures
