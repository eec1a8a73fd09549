"""A float32 model's own answers, resident and without speculation: the
reference many exactness tests compare with. Each answer is computed once per test module
(`References`, a module-scoped fixture's value) instead of once per test; offloaded and
batched answers are held bit for bit equal to it elsewhere (tests/llm/test_llm.py,
tests/llm/test_invariant_by_default.py)."""

from __future__ import annotations

from offload import LLM, SamplingParams


class References:
    """`generate` of a resident float32 default model, each (prompts, params, alone)
    answered once. Made in a module-scoped fixture (an `LLM` made inside a test is closed
    when the test ends: tests/conftest.py)."""

    def __init__(self, path) -> None:
        self._llm = LLM(path, dtype="float32")
        self._answers: dict[tuple, list] = {}

    def generate(self, prompts, params: SamplingParams | list, alone: bool = False) -> list:
        """As `LLM.generate(prompts, params)`; `alone`: each prompt by itself."""
        listed = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        key = (repr(listed), repr(params), alone)
        if key not in self._answers:
            if alone:
                answers = [self._llm.generate(p, params, use_tqdm=False)[0] for p in listed]
            else:
                answers = self._llm.generate(listed, params, use_tqdm=False)
            self._answers[key] = answers
        return self._answers[key]

    def close(self) -> None:
        self._llm.close()
