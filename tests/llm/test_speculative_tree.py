"""Speculative decoding's tree form (`tree_budget`): a tree of guesses scored in one
forward gives the model's own tokens — resident, from disk and with KV offload, alone
and in a batch — keeps more guesses than the chain alone, and on the default model as
stored every kept token carries the decode step's bits."""

import pytest

from offload import SamplingParams
from offload.engine import speculative, step_runner
from offload.engine.speculative import SpeculativeConfig
from offload.errors import ConfigError
from offload.llm.llm import LLM

# (a text that repeats with changes: lookup finds several continuations of a suffix)
PROMPTS = [
    "The cat sat on the mat. The dog sat on the log. The cat ran to the mat. " * 2
    + "Say it again:",
    "List the numbers from 1 to 30: 1, 2, 3, 4,",
    "What is the capital of France?",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip
TREE = {**NGRAM, "tree_budget": 12}
GREEDY = SamplingParams(temperature=0, max_tokens=32)


@pytest.fixture
def always_guess(monkeypatch):
    monkeypatch.setattr(speculative.Pace, "guesses", lambda self: max(self.depths))


def _tokens(outputs):
    return [output.outputs[0].token_ids for output in outputs]


def test_the_tree_budget_is_read_and_bounded():
    assert SpeculativeConfig.of(TREE).tree_budget == 12
    assert SpeculativeConfig.of({"method": "ngram", "tree_budget": 3}).tree_budget == 3
    for value, needle in (
        ({**NGRAM, "tree_budget": 0}, "tree_budget must be an integer from 1 to 256, got 0"),
        ({**NGRAM, "tree_budget": 300}, "from 1 to 256, got 300"),
        ({**NGRAM, "tree_budget": 2}, "tree_budget (2) must hold the num_speculative_tokens (4)"),
    ):
        with pytest.raises(ConfigError, match="speculative_config") as caught:
            SpeculativeConfig.of(value)
        assert needle in str(caught.value)


@pytest.mark.parametrize(
    "setting",
    [{}, {"cpu_memory_gb": 0, "disk_io": "direct"}, {"kv_offload": True}],
    ids=["resident", "disk", "kv offload"],
)
def test_a_tree_gives_the_model_s_tokens_alone_and_batched(
    short_path, plain, tmp_path, always_guess, setting
):
    if "cpu_memory_gb" in setting:
        setting = {**setting, "offload_folder": str(tmp_path)}
    chain = LLM(short_path, dtype="float32", speculative_config=NGRAM, **setting)
    tree = LLM(short_path, dtype="float32", speculative_config=TREE, **setting)
    expected = plain.generate(PROMPTS, GREEDY, alone=True)
    for llm in (chain, tree):
        assert _tokens(llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)) == _tokens(expected[:1])
    kept = [llm.transfer_stats().num_spec_accepted_tokens for llm in (chain, tree)]
    assert kept[1] > kept[0]  # (a sibling's guess kept where the chain's was wrong)
    eight = (PROMPTS * 3)[:8]
    assert _tokens(tree.generate(eight, GREEDY, use_tqdm=False)) == _tokens((expected * 3)[:8])
    for llm in (chain, tree):
        llm.close()


def test_a_draft_s_tree_gives_the_model_s_tokens(short_path, short_gguf, plain, always_guess):
    draft = {"model": str(short_gguf), "num_speculative_tokens": 4, "tree_budget": 8}
    tree = LLM(short_path, dtype="float32", speculative_config=draft)
    assert _tokens(tree.generate(PROMPTS, GREEDY, use_tqdm=False)) == _tokens(
        plain.generate(PROMPTS, GREEDY)
    )
    moved = tree.transfer_stats()
    assert moved.num_spec_draft_tokens > 4 * moved.num_spec_drafts  # (trees: more than k each)


def test_the_stored_model_s_tree_tokens_carry_the_decode_steps_bits(
    short_gguf, always_guess, monkeypatch
):
    """Where a kept path is not the first branch, its nodes attend to their path laid out
    as the decode step's columns (`verify_attention`'s gathers), and their KV columns move
    to the row's next columns (`StepRunner.keep_paths`): tokens and logprobs bit for bit."""
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=3)
    plain, tree = LLM(short_gguf), LLM(short_gguf, speculative_config=TREE)
    moved = []
    keep = step_runner.StepRunner.keep_paths

    def counting(self, rows, paths):
        moved.extend(path for path in paths if path and path[0] != 1)
        return keep(self, rows, paths)

    monkeypatch.setattr(step_runner.StepRunner, "keep_paths", counting)
    for prompt in PROMPTS[:2]:
        [mine] = tree.generate(prompt, params, use_tqdm=False)
        [theirs] = plain.generate(prompt, params, use_tqdm=False)
        assert _answers(mine) == _answers(theirs)
    assert moved  # (paths off the first branch were kept, and moved)


def _answers(output) -> tuple:
    completion = output.outputs[0]
    return completion.token_ids, [
        {token: lp.logprob for token, lp in entry.items()} for entry in completion.logprobs
    ]
