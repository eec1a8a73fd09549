"""Each GGUF weight's layout is chosen by timing its candidates on this machine: a
kernel that times slower than de-quantizing GGUF's blocks is not chosen, and a q8 weight
is timed as the compiled CPU step runs it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from offload.model.default import gguf_path
from offload.model.gguf_fast import FastReader
from offload.probes import layout_choice
from offload.quant.layouts import layout_for


@pytest.fixture(scope="module")
def file_tensors():
    return {t.name: np.asarray(t.data) for t in FastReader(gguf_path()).tensors}


def test_a_slower_kernel_is_not_chosen(file_tensors, monkeypatch):
    """Where the kernel's product times slower than de-quantizing GGUF's blocks (a CPU
    without the vector units the 4-bit kernels are written for), the blocks are kept."""
    name, raw = "model.layers.0.mlp.up_proj.weight", file_tensors["blk.0.ffn_up.weight"]
    chooser = layout_choice.LayoutChooser("cpu")
    four_bit = layout_for("Q4_1", name, "cpu")  # (q4 where the CPU has VNNI, else int4)
    assert chooser.choose(name, raw, "Q4_1") == four_bit  # (as measured on this machine)
    _times_slower(monkeypatch, four_bit)
    slow = layout_choice.LayoutChooser("cpu")
    assert slow.choose(name, raw, "Q4_1") == "gguf"
    assert slow.seconds == {"Q4_1 1536x576": {four_bit: 2e-3, "gguf": 1e-3}}
    assert layout_choice.LayoutChooser("cuda").choose(name, raw, "Q4_1") in ("gguf", "int4_cuda")


def _times_slower(monkeypatch, layout: str) -> None:
    """The chooser's eager timings made up: `layout` 2 ms, any other 1 ms."""
    timings = {layout: 2e-3}
    monkeypatch.setattr(
        layout_choice, "product_seconds", lambda n, r, k, kept, *_: timings.get(kept, 1e-3)
    )


def test_a_q8_weight_is_timed_as_the_compiled_cpu_step_runs_it(file_tensors, monkeypatch):
    """Where the eager q8 product loses to de-quantizing the blocks, the choice is made on
    the product a compiled CPU step runs (one loop over the int8 weight, `q8_one_row`);
    where nothing compiles here, on the eager timings."""
    name = "model.layers.0.mlp.up_proj.weight"
    raw = torch.from_numpy(np.array(file_tensors["token_embd.weight"][:1536]))
    _times_slower(monkeypatch, "q8")
    chooser = layout_choice.LayoutChooser("cpu")
    assert chooser.choose(name, raw, "Q8_0") == "q8"
    timed = chooser.seconds["Q8_0 1536x576"]
    assert timed["q8"] == timed["q8 compiled"] < 1e-3 < timed["gguf"] * 1.01
    monkeypatch.setattr(layout_choice, "compiled_q8_seconds", lambda *_: float("inf"))
    assert layout_choice.LayoutChooser("cpu").choose(name, raw, "Q8_0") == "gguf"


def test_q8_timings_of_many_shapes_do_not_share_one_compile_cache(file_tensors):
    """Each shape's compiled q8 product is timed on its own code object: torch.compile
    keeps a limit of 8 compiles per code object and past it runs the loop eagerly, which
    timed a CI run's q8 weights as the eager loop and chose the blocks instead."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from offload.quant.kernels import q8_one_row

    table = torch.from_numpy(np.array(file_tensors["token_embd.weight"][:256]))
    for rows in range(16, 16 * 11, 16):  # (10 shapes: past the limit, were they shared)
        assert layout_choice.compiled_q8_seconds("x.weight", table[:rows], "Q8_0") < 1.0
    assert _debug_get_cache_entry_list(q8_one_row.__code__) == []
