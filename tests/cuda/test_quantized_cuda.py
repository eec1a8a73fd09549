"""Weights kept as stored on a real GPU: every GGUF type de-quantizes there to the CPU's
values bit for bit; the 4-bit types in torch's GPU int4 packing hold the file's integers
and multiply like their de-quantized weights; a Q4_0 model, in GGUF's blocks or in that
packing, gives its resident tokens offloaded every way and with CUDA graphs."""

import gc

import pytest
import torch
import torch.nn.functional as F
from zoo import save_q4_0_shape

from offload import SamplingParams
from offload.llm.llm import LLM
from offload.quant.gguf_quants import FORMATS, affine_4bit, dequantize
from offload.quant.kernels import int4_cuda_matmul
from offload.quant.layouts import INT4_TYPES, int4_cuda_layout
from offload.quant.quantized import GGUFLinear, Int4CudaLinear
from offload.quant.traits import laid_out

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
           "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "Q2_K": [80, 82], "Q3_K": [108]}  # fmt: skip


def _random_blocks(kind: str, rows: int = 64, blocks: int = 8) -> torch.Tensor:
    block = FORMATS[kind]
    generator = torch.Generator().manual_seed(len(kind))
    shape = (rows, blocks, block.block_bytes)
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
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


@pytest.mark.parametrize("kind", list(FORMATS))
def test_every_type_dequantizes_inside_a_cuda_graph(kind):
    """A decode step's graph captures the de-quantization of the weights kept in GGUF's
    blocks: nothing in it may copy from the host (a capture refuses that), and each replay
    writes the eager values."""
    raw = _random_blocks(kind).to(DEVICE)
    expected = dequantize(raw, kind)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dequantize(raw, kind)  # (warm-up away from the capture, as torch advises)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dequantize(raw, kind)
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, expected)


@pytest.mark.parametrize("kind", INT4_TYPES)
def test_the_gpu_int4_packing_holds_the_files_integers(kind):
    assert int4_cuda_layout() is not None  # (an sm_80+ GPU: tinygemm's packing reads back)
    raw = _random_blocks(kind, rows=96)
    tensors = laid_out("w.weight", raw, kind, "int4_cuda")
    packed, scale_zero = tensors["w.weight"].to(DEVICE), tensors["w.scale_zero"].to(DEVICE)
    q, scale, offset = affine_4bit(raw, kind)
    values = q.shape[1]
    unit = torch.tensor([1.0, 8.0], dtype=torch.bfloat16).expand(values // 32, 96, 2)
    eye = torch.eye(values, device=DEVICE)
    back = int4_cuda_matmul(eye, packed, unit.contiguous().to(DEVICE))
    assert torch.equal(back.T.cpu(), q.float())  # (q - 8) * 1 + 8: the stored integers
    assert torch.equal(scale_zero[..., 0].cpu(), scale.T.bfloat16())
    assert torch.equal(scale_zero[..., 1].cpu(), (offset + 8 * scale).T.bfloat16())
    # The product is the de-quantized weight's, to bfloat16 rounding.
    x = torch.randn(5, values, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    expected = F.linear(x.bfloat16().float(), dequantize(raw, kind).to(DEVICE))
    got = int4_cuda_matmul(x, packed, scale_zero)
    assert torch.allclose(got, expected, rtol=0.02, atol=0.02 * float(expected.abs().max()))


@pytest.fixture(scope="module", params=["gguf", "cuda"])
def q4_0(request, tmp_path_factory):
    return save_q4_0_shape(tmp_path_factory.mktemp("q4_0") / "model", kernels=request.param)


def _tokens(llm):
    return [
        o.outputs[0].token_ids
        for params in (GREEDY, SAMPLED)
        for o in llm.generate(PROMPTS, params, use_tqdm=False)
    ]


def _run(path, **settings):
    with LLM(path, device=DEVICE, **settings) as llm:
        tokens, moved = _tokens(llm), llm.transfer_stats()
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, moved


@pytest.fixture(scope="module")
def resident(q4_0):
    return _run(q4_0, enforce_eager=True)[0]


def test_the_stored_model_keeps_its_4_bit_weights_on_the_gpu(q4_0):
    with LLM(q4_0, device=DEVICE, enforce_eager=True) as llm:
        q_proj = llm.model.model.layers[0].self_attn.q_proj
        assert q_proj.weight.device.type == DEVICE
        if q4_0.name.endswith("cuda"):
            assert isinstance(q_proj, Int4CudaLinear) and q_proj.weight.dtype == torch.int32
            assert q_proj.weight.numel() * 4 == 576 * 576 // 2  # 4 bits a weight
        else:
            assert isinstance(q_proj, GGUFLinear) and q_proj.weight.shape == (576, 576 // 32 * 18)


def test_cuda_graph_decode_of_the_stored_model_equals_eager(q4_0, resident):
    tokens, moved = _run(q4_0)
    assert tokens == resident and moved.num_graph_replays > 0


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_the_stored_model_offloaded_equals_it_resident(q4_0, resident, setting):
    tokens, moved = _run(q4_0, **SETTINGS[setting])
    assert tokens == resident
    if "offload_group_size" in SETTINGS[setting]:  # its stored bytes were copied in
        assert moved.weight_copied_bytes > 0
