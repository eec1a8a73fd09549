"""Weights kept as stored (GGUF blocks) on a real GPU: every type de-quantizes there to the
CPU's values bit for bit, and a Q4_0 model offloaded every way gives its resident tokens."""

import gc

import pytest
import torch
from zoo import save_q4_0_shape

from offload import SamplingParams
from offload.llm.llm import LLM
from offload.model.gguf_quants import FORMATS, dequantize

pytestmark = pytest.mark.cuda
DEVICE = "cuda"
PROMPTS = ["t5 t6 t7 t8 t9 t10", "t100 t200", "t3 t4 t5 t6 t7 t8 t9 t10 t11 t12 t13"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)
SETTINGS = {
    "uva": {"cpu_offload_gb": 0.01},
    "prefetch": {"offload_group_size": 1, "offload_prefetch_step": 2},
    "prefetch+kv-cache": {"offload_group_size": 1, "offload_prefetch_step": 2, "kv_offload": True},
    "graphs": {"offload_group_size": 2, "offload_num_in_group": 1},
}
# Byte offsets of each type's float16 fields (scales, minimums): random there would be
# NaN or huge; every other byte is random.
_F16_AT = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
           "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}  # fmt: skip


def _random_blocks(kind: str, rows: int = 64, blocks: int = 8) -> torch.Tensor:
    block = FORMATS[kind]
    generator = torch.Generator().manual_seed(len(kind))
    raw = torch.randint(
        0, 256, (rows, blocks, block.block_bytes), dtype=torch.uint8, generator=generator
    )
    for at in _F16_AT[kind]:
        halves = (torch.rand(rows, blocks, generator=generator) * 0.01).half()
        raw[..., at : at + 2] = halves.unsqueeze(-1).view(torch.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", list(FORMATS))
def test_every_type_dequantizes_on_the_gpu_to_the_cpus_values(kind):
    raw = _random_blocks(kind)
    on_cpu = dequantize(raw, kind)
    assert torch.isfinite(on_cpu).all() and on_cpu.abs().sum() > 0
    assert torch.equal(dequantize(raw.to(DEVICE), kind).cpu(), on_cpu)


@pytest.fixture(scope="module")
def q4_0(tmp_path_factory):
    return save_q4_0_shape(tmp_path_factory.mktemp("q4_0") / "model")


def _tokens(llm):
    return [
        o.outputs[0].token_ids
        for p in (GREEDY, SAMPLED)
        for o in llm.generate(PROMPTS, p, use_tqdm=False)
    ]


def _run(path, **settings):
    with LLM(path, device=DEVICE, **settings) as llm:
        tokens, moved = _tokens(llm), llm.transfer_stats()
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return tokens, moved


@pytest.fixture(scope="module")
def resident(q4_0):
    return _run(q4_0, enforce_eager=True)[0]


def test_the_stored_model_keeps_its_blocks_on_the_gpu(q4_0):
    with LLM(q4_0, device=DEVICE, enforce_eager=True) as llm:
        q_proj = llm.model.model.layers[0].self_attn.q_proj
        assert q_proj.weight.dtype == torch.uint8 and q_proj.weight.device.type == DEVICE
        assert q_proj.weight.shape == (576, 576 // 32 * 18)


def test_cuda_graph_decode_of_the_stored_model_equals_eager(q4_0, resident):
    tokens, moved = _run(q4_0)
    assert tokens == resident and moved.num_graph_replays > 0


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_the_stored_model_offloaded_equals_it_resident(q4_0, resident, setting):
    tokens, moved = _run(q4_0, **SETTINGS[setting])
    assert tokens == resident
    if "offload_group_size" in SETTINGS[setting]:  # its stored bytes were copied in
        assert moved.weight_copied_bytes > 0
