"""The CPU linear over a few rows (`weight @ x.T`, one row as a batch of matrix-vector
products): the same product as `F.linear` up to rounding, taken only where it was measured
to pay, and only in the thread that asks."""

import threading

import pytest
import torch
import torch.nn.functional as F

from offload.engine import cpu_linear
from offload.engine.cpu_linear import MAX_ROWS, FewRowsLinear, few_rows_linear
from offload.quant import row_dot


@pytest.fixture(autouse=True)
def _blas_forms(monkeypatch):
    """These are the forms taken where the row-invariant products are not built (no C
    compiler): tests/quant/test_row_dot.py and tests/llm/test_invariant_by_default.py
    hold the ones taken where they are."""
    monkeypatch.setattr(row_dot, "library", lambda: None)


@pytest.mark.parametrize(
    "shape", [(1, 24), (1, 1, 24), (24,), (2, 24), (4, 1, 24), (3, 5, 24), (MAX_ROWS, 24)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_it_is_the_linear_product(shape, with_bias):
    torch.manual_seed(0)
    x, weight = torch.randn(shape), torch.randn(40, 24)
    bias = torch.randn(40) if with_bias else None
    got = few_rows_linear(x, weight, bias)
    assert got is not None and got.is_contiguous()
    assert got.shape == (*shape[:-1], 40)
    torch.testing.assert_close(got, F.linear(x, weight, bias))


@pytest.mark.parametrize(
    "x, weight",
    [
        (torch.randn(1, 24), torch.randn(41, 24)),  # one row of rows in no two blocks
        (torch.randn(1, 24), torch.randn(24, 40).T),  # a weight that is not contiguous
        (torch.randn(MAX_ROWS + 1, 24), torch.randn(40, 24)),  # many: the same
        (torch.randn(4, 24, dtype=torch.bfloat16), torch.randn(40, 24, dtype=torch.bfloat16)),
        (torch.randn(4, 24), torch.randn(2, 40, 24)),
    ],
)
def test_it_declines_where_it_was_not_measured_to_pay(x, weight):
    assert few_rows_linear(x, weight) is None


def test_a_weight_of_a_tensor_subclass_keeps_its_own_kernel():
    class Marked(torch.Tensor):
        pass

    weight = torch.randn(40, 24).as_subclass(Marked)
    assert few_rows_linear(torch.randn(4, 24), weight) is None


def test_the_mode_routes_linear_in_its_own_thread_only():
    torch.manual_seed(0)
    x, weight = torch.randn(4, 576), torch.randn(1536, 576)
    plain, few = F.linear(x, weight), few_rows_linear(x, weight)
    assert not torch.equal(plain, few)  # (they round differently: so routing shows)
    elsewhere = []
    with FewRowsLinear():
        routed = F.linear(x, weight)
        thread = threading.Thread(target=lambda: elsewhere.append(F.linear(x, weight)))
        thread.start()
        thread.join()
        module = torch.nn.Linear(576, 1536, bias=False)
        module.weight.data = weight
        with torch.no_grad():
            through_module = module(x)
    assert torch.equal(routed, few) and torch.equal(through_module, few)
    assert torch.equal(elsewhere[0], plain)


def test_a_rows_product_does_not_depend_on_the_threads_or_blocks():
    """One row's product takes ATen's batched kernel, whose outputs are each one dot
    product: the same bits for any number of threads (and so of row blocks)."""
    torch.manual_seed(0)
    x, weight = torch.randn(1, 576), torch.randn(1536, 576)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3, 4):
            torch.set_num_threads(count)
            results.append(few_rows_linear(x, weight))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])
    assert not torch.equal(results[0], F.linear(x, weight))  # (routed: it rounds otherwise)


def test_the_mode_is_taken_only_where_the_float32_weights_are_large():
    """Its per-call cost pays only where streaming the weights is the step's time: not for
    small models, nor for quantized ones (the default model as stored), nor on a GPU."""
    from offload.engine.cpu_linear import PAYS_BYTES, kernels_for

    cpu = torch.device("cpu")
    large = torch.nn.Sequential(torch.nn.Linear(2048, PAYS_BYTES // 4 // 2048, bias=False))
    small = torch.nn.Sequential(torch.nn.Linear(64, 96))
    halves = torch.nn.Sequential(torch.nn.Linear(2048, 4096)).to(torch.bfloat16)
    assert isinstance(kernels_for(large, cpu), FewRowsLinear)
    assert not isinstance(kernels_for(small, cpu), FewRowsLinear)
    assert not isinstance(kernels_for(halves, cpu), FewRowsLinear)
    assert not isinstance(kernels_for(large, torch.device("cuda")), FewRowsLinear)


@pytest.mark.parametrize("offset", [4, 8, 40])
@pytest.mark.parametrize("rows", [2, 4, 33])
def test_a_batchs_product_does_not_depend_on_where_the_weight_lies(offset, rows):
    """A weight read or mapped from a file lies where its offset puts it; MKL's sums over
    one 4 or 8 bytes off a 16-byte boundary rounded differently (the disk tier's batches
    then differed from resident's). The product gives the aligned weight's bits."""
    torch.manual_seed(0)
    weight = torch.randn(1536, 576)
    x = torch.randn(rows, 576)
    buffer = torch.empty(weight.numel() + 16)
    moved = buffer[offset // 4 :][: weight.numel()].view_as(weight).copy_(weight)
    assert moved.data_ptr() % cpu_linear.ALIGNMENT == offset
    expected = cpu_linear.few_rows_linear(x, weight)
    assert torch.equal(cpu_linear.few_rows_linear(x, moved), expected)
    assert torch.equal(
        cpu_linear.WEIGHT_TIMES(moved, x.t()), cpu_linear.weight_times(weight, x.t())
    )


@pytest.mark.parametrize("rows", [2, 4, 8])
def test_a_batchs_product_does_not_depend_on_how_its_columns_are_laid_out(rows):
    """A compiled step may hand the op its columns row-major (the down projection's input,
    fused from the products before it): MKL's sums over them round differently, and took
    ~3x as long. The op gives the bits of the eager step's layout (`x.t()`)."""
    torch.manual_seed(0)
    weight = torch.randn(576, 1536)
    x = torch.randn(rows, 1536)
    expected = cpu_linear.weight_times(weight, x.t())
    assert torch.equal(cpu_linear.WEIGHT_TIMES(weight, x.t().contiguous()), expected)
    assert torch.equal(cpu_linear.few_rows_linear(x, weight).t(), expected)


def _misaligned(path, by: int):
    """The safetensors file at `path` rewritten so that its tensor bytes begin `by` bytes
    past a 64-byte boundary (its header padded with spaces), as a checkpoint may come."""
    file = path / "model.safetensors"
    data = file.read_bytes()
    start = 8 + int.from_bytes(data[:8], "little")
    header = data[8:start].rstrip(b" ")
    header += b" " * ((by - 8 - len(header)) % 64)
    file.write_bytes(len(header).to_bytes(8, "little") + header + data[start:])
    return path


@pytest.mark.parametrize("by", [8, 40])
def test_a_batch_on_the_disk_tier_of_a_misaligned_checkpoint_gives_the_resident_bits(tmp_path, by):
    """The disk tier reads tensors at their file offsets modulo 4 KiB, then moves each to
    an aligned home; a batch's products there give the bits they give resident (the real
    model's shapes: MKL rounds differently over an unaligned 576-wide weight)."""
    import transformers as tf

    from offload import LLM, SamplingParams
    from tests import zoo

    shape = tf.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                           num_attention_heads=9, num_key_value_heads=3, vocab_size=512)  # fmt: skip
    torch.manual_seed(0)
    path = _misaligned(zoo.save_with_tokenizer(tf.LlamaForCausalLM(shape), tmp_path), by)
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i, 9, 14 * i + 1]} for i in range(4)]

    def run(**settings):
        llm = LLM(path, device="cpu", dtype="float32", enforce_eager=True, **settings)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], llm

    resident, _ = run()
    on_disk, llm = run(cpu_memory_gb=0)
    weight = llm.model.model.layers[0].mlp.up_proj.weight
    assert weight.data_ptr() % 256 == 0  # (the file put it `by` past a 64-byte boundary)
    moved = llm.transfer_stats()
    assert moved.disk_read_bytes + moved.disk_mapped_bytes > 0
    assert on_disk == resident
