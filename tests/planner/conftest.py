"""Fixtures of the planner's tests: the recorded measurement sets (recorded.json, written
by hand) and the model shapes they were taken with, built on the meta device."""

import json
from pathlib import Path

import pytest
import torch
import transformers as tf

from offload.model.configs import resolve
from offload.planner.measurements import Measured, Measurements
from offload.planner.plan import Plan, make_plan
from offload.planner.shape import shape_of

RECORDED = Path(__file__).parent / "recorded.json"
CONTEXT_LEN = 1024


def meta_model(hf_config, dtype: torch.dtype) -> torch.nn.Module:
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = tf.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.tie_weights()
    return model


@pytest.fixture(scope="session")
def recorded() -> dict[str, Measurements]:
    sets = json.loads(RECORDED.read_text())
    return {name: Measurements(**figures) for name, figures in sets.items() if name[0] != "_"}


@pytest.fixture(scope="session")
def shape_from():
    """shape_from(hf_config, dtype): a model's shape, built on the meta device."""
    return lambda hf_config, dtype: shape_of(meta_model(hf_config, dtype), CONTEXT_LEN)


@pytest.fixture(scope="session")
def llama8b_shape():
    config = tf.AutoConfig.from_pretrained(resolve("llama-3-8b"))
    return shape_of(meta_model(config, torch.bfloat16), CONTEXT_LEN)


@pytest.fixture(scope="session")
def smollm2_shape(smollm2_path):
    config = tf.AutoConfig.from_pretrained(smollm2_path)
    return shape_of(meta_model(config, torch.float32), CONTEXT_LEN)


# A mixture of experts: 64 experts a layer, 2 a token (large enough that the experts, not
# the activations, decide what fits).
_MOE = dict(hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512)
_MOE.update(num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=128)
_MOE.update(num_experts=64, num_experts_per_tok=2, vocab_size=32000)


@pytest.fixture(scope="session")
def moe_shape(shape_from):
    return shape_from(tf.Qwen3MoeConfig(**_MOE), torch.bfloat16)


@pytest.fixture(scope="session")
def planned():
    """plan(shape, figures, budgets, batch sizes): the plan for a recorded set."""

    def plan(shape, figures: Measurements, budgets, batch_sizes=None) -> Plan:
        sizes = batch_sizes or figures.batch_sizes
        return make_plan(shape, Measured(figures, RECORDED, True), budgets, sizes, RECORDED)

    return plan
