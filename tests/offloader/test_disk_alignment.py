"""A weight streamed by the disk tier sits in its buffer where its file offset puts it
(modulo the read's alignment), so a safetensors file whose tensors are not 64-byte aligned
gives weights off a 64-byte boundary, and MKL's sums over such a weight round differently:
found 2026-11-29 with this 2-layer model (every linear weight 24 bytes past a boundary;
the 4-layer one of the compiled-step tests happens to be aligned). Until the disk tier places
its tensors aligned (or every product copies a misaligned weight first), this is a known
break of the exactness promise: strict, so that the fix turns it into a failure to remove."""

import pytest
import zoo

from offload import SamplingParams
from offload.llm.llm import LLM

PROMPTS = [[5, 9, 14, 3], [7, 3], [30, 2, 8, 11, 4, 6], [12], [9, 9, 9]]
PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)


def _answers(llm) -> list:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [
        (c.token_ids, [{t: lp.logprob for t, lp in e.items()} for e in c.logprobs])
        for o in outputs
        for c in o.outputs
    ]


@pytest.mark.xfail(strict=True, reason="disk-tier weights off a 64-byte boundary (open)")
def test_a_misaligned_checkpoint_on_the_disk_tier_gives_the_resident_bits(tmp_path):
    path = zoo.save_attentive_llm(tmp_path, num_layers=2)
    with LLM(path, device="cpu", dtype="float32") as resident:
        expected = _answers(resident)
    with LLM(path, device="cpu", dtype="float32", cpu_memory_gb=0, disk_io="direct") as llm:
        got = _answers(llm)
        assert llm.offloader.stats().disk.bytes_read > 0
        misaligned = [p.data_ptr() % 64 for p in llm.model.parameters() if p.dim() == 2]
    assert any(misaligned)  # (the case this test is about)
    assert got == expected
