"""Requests from several threads at once, as `offload serve` gets them, and the random
prompts they send."""

from __future__ import annotations

import queue
import random
import threading

# Prompts of these lengths in tokens, answering this many: rows free up while others decode,
# so that later prompts ride in running rows' decode steps (`test_paced_chunks`, `test_packed_step`)
RIDING_LENGTHS = (3, 5, 90, 40, 7, 33, 2, 64)
RIDING_STOPS = (2, 14, 2, 2, 9, 2, 11, 4)


def streamed_apart(llm, prompts, params, answer) -> list:
    """Each prompt streamed by `llm.stream` on a thread of its own, all started together
    (they join the running batch at different steps): `answer` of each one's last output,
    in the prompts' order."""
    outputs: dict[int, object] = {}

    def stream(index: int) -> None:
        *_, last = llm.stream(prompts[index], params)
        outputs[index] = answer(last)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return [outputs.get(i) for i in range(len(prompts))]


def random_prompts(vocab: int, lengths, seed: int = 0) -> list[dict]:
    """One prompt of random token ids (none of the first three) per length in `lengths`."""
    generator = random.Random(seed)
    return [
        {"prompt_token_ids": [generator.randrange(3, vocab) for _ in range(length)]}
        for length in lengths
    ]


def last_output(outputs: queue.Queue):
    """The finished output a request's `emit` put on `outputs` (the error it raised, if
    one came instead)."""
    while True:
        item = outputs.get(timeout=120)
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            return item


def answer_of(output) -> tuple:
    """A request's tokens and the logprobs of each step (every token listed, sorted)."""
    completion = output.outputs[0]
    return tuple(completion.token_ids), tuple(
        tuple(sorted((token, entry.logprob) for token, entry in step.items()))
        for step in completion.logprobs
    )


def check_invariant(llm, prompts, params) -> None:
    """Each prompt answered bit for bit alike alone, in a batch of all of them, and in
    another mix (shuffled, two left out)."""
    alone = [answer_of(llm.generate([p], params, use_tqdm=False)[0]) for p in prompts]
    together = [answer_of(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert together == alone
    order = list(range(len(prompts)))
    random.Random(1).shuffle(order)
    some = order[: len(order) - 2]
    mixed = llm.generate([prompts[i] for i in some], params, use_tqdm=False)
    assert [answer_of(o) for o in mixed] == [alone[i] for i in some]
