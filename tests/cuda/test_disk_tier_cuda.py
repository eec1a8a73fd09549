"""The disk tier on a real GPU: disk -> pinned staging -> copy stream -> device slot."""

import pytest
import torch
import zoo

from offload.model.loader import load_model
from offload.offloader.disk_tier import ReadHooks

pytestmark = pytest.mark.cuda
EVERY_LAYER = {"offload_group_size": 1, "offload_num_in_group": 1, "offload_prefetch_step": 2}


@pytest.mark.parametrize("io", ["direct", "page-cache"])
@pytest.mark.parametrize("delay_s", [0.0, 0.002])
def test_streamed_layers_on_the_gpu_give_the_resident_logits_and_tokens(
    checkpoint, reference, io, delay_s
):
    ids, logits, tokens = reference
    config = {**EVERY_LAYER, "cpu_memory_gb": 0.1, "disk_io": io, "read_ahead": 2}
    hooks = ReadHooks(delay_s=delay_s)
    model, offloader = load_model(checkpoint, config, device="cuda", read_hooks=hooks)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False
        )
    assert torch.equal(out, tokens)
    stats = offloader.stats()
    assert stats.disk.num_units > 0 and stats.disk.bytes_read > 0
    assert stats.disk.staging_bytes > 0 and stats.bytes_copied > 0  # staged, then copied
    offloader.close()


def test_a_sharded_checkpoint_streams_to_the_gpu(tmp_path):
    resident = zoo.build("llama", num_layers=6)
    resident.save_pretrained(tmp_path, max_shard_size="60KB")
    ids = zoo.inputs().to("cuda")
    expected = zoo.logits(resident.to("cuda"), ids)
    model, offloader = load_model(tmp_path, {**EVERY_LAYER, "cpu_memory_gb": 0}, device="cuda")
    assert torch.equal(zoo.logits(model, ids), expected)
    offloader.close()


def test_llm_with_a_disk_tier_decodes_eagerly_and_exactly(checkpoint, tmp_path):
    """Disk reads are queued by a staging thread: a CUDA graph would not capture them."""
    from offload import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(5, 21))}
    with LLM(checkpoint, device="cuda", offload_group_size=1, offload_prefetch_step=2) as llm:
        expected = llm.generate(prompt, greedy)[0].outputs[0].token_ids
    with LLM(checkpoint, device="cuda", cpu_memory_gb=0) as llm:
        assert not llm._use_graphs
        assert llm.generate(prompt, greedy)[0].outputs[0].token_ids == expected
        assert llm.transfer_stats().disk_read_bytes > 0
