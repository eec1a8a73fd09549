import gc

import pytest
import torch

from offload.demo import greedy, load_pretrained

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def reference(smollm2_path):
    """SmolLM2 resident on the GPU: tokenizer, prompt ids, logits, greedy tokens."""
    model, tokenizer = load_pretrained(smollm2_path)
    model.to("cuda")
    ids = tokenizer(QUESTION, return_tensors="pt").input_ids.to("cuda")
    with torch.no_grad():
        logits = model(ids).logits
    tokens, _ = greedy(model, tokenizer, QUESTION, 12)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return tokenizer, ids, logits, tokens
