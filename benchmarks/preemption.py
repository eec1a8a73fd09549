"""Preemption within a KV room (issue 50: "32 concurrent requests with KV room for 8 -> all
32 complete, greedy answers equal to each one alone; vllm:num_preemptions_total counts
them"), on the default model: 32 prompts of 10-25 tokens, greedy, `--max-tokens` each with
`ignore_eos`, `max_model_len` 128 and a KV room of 8 rows of 128 positions
(`kv_cache_memory_bytes`). Each prompt alone, then all 32 in one `generate` and, through
the server's engine (`LLM.serving`), all 32 submitted at once; the preemptions counted;
each answer compared with its answer alone, tokens and their logprobs. Default and
batch-invariant mode (`--modes`), the model as stored and in float32 (`--forms`).

This measures exactness, not speed; the wall times are one run each, printed for scale.
Run: `python benchmarks/preemption.py`; results JSON in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import queue
import time

import torch
from common import save

from offload import LLM, SamplingParams
from offload.engine.rows import bytes_per_row
from offload.sizes import compute_dtype

LENGTH = 128  # max_model_len
ROWS = 8  # the KV room, in rows of LENGTH positions


def _answer(completion) -> tuple:
    logprobs = tuple(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs))  # noqa: B905
    return tuple(completion.token_ids), logprobs


def _served(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[tuple]:
    serving = llm.serving()
    queues = [queue.Queue() for _ in prompts]
    requests = [serving.prepare(None, p, params, q.put) for p, q in zip(prompts, queues)]  # noqa: B905
    serving.core.submit_all(requests)
    answers = []
    for outputs in queues:
        while True:
            item = outputs.get(timeout=3600)
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                answers.append(_answer(item.outputs[0]))
                break
    return answers


def run(form: str, invariant: bool, max_tokens: int) -> dict:
    kwargs = {} if form == "stored" else {"dtype": form}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    with LLM(max_model_len=LENGTH, **kwargs) as probe:
        room = ROWS * bytes_per_row(probe.model.config, LENGTH, compute_dtype(probe.model))
    with LLM(batch_invariant=invariant, max_model_len=LENGTH, kv_cache_memory_bytes=room,
             **kwargs) as llm:  # fmt: skip
        tokenizer = llm.get_tokenizer()
        texts = [f"Story number {i}: once upon a time there was a" + " very" * (i % 7)
                 for i in range(32)]  # fmt: skip
        prompts = [tokenizer(text).input_ids for text in texts]
        started = time.perf_counter()
        alone = [
            _answer(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0])
            for p in prompts
        ]
        alone_s = time.perf_counter() - started
        started = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        together_s = time.perf_counter() - started
        together = [_answer(o.outputs[0]) for o in outputs]
        core = llm._generator.core
        generate_preemptions = core.scheduler.num_preemptions
        served = _served(llm, prompts, params)
        served_preemptions = llm.serving().core.scheduler.num_preemptions
    return {
        "form": form,
        "batch_invariant": invariant,
        "room_positions": core.scheduler.room,
        "rows": core.max_rows,
        "generate_preemptions": generate_preemptions,
        "served_preemptions": served_preemptions,
        "generate_tokens_equal_alone": sum(a[0] == b[0] for a, b in zip(alone, together)),  # noqa: B905
        "generate_bits_equal_alone": sum(a == b for a, b in zip(alone, together)),  # noqa: B905
        "served_tokens_equal_alone": sum(a[0] == b[0] for a, b in zip(alone, served)),  # noqa: B905
        "served_bits_equal_alone": sum(a == b for a, b in zip(alone, served)),  # noqa: B905
        "requests": len(prompts),
        "alone_s": alone_s,
        "together_s": together_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forms", nargs="+", default=["float32", "stored"])
    parser.add_argument("--modes", nargs="+", default=["invariant", "default"],
                        choices=["invariant", "default"])  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=40)
    args = parser.parse_args()
    records = []
    for form in args.forms:
        for mode in args.modes:
            record = run(form, mode == "invariant", args.max_tokens)
            records.append(record)
            print(
                f"{form:8} {mode:9} room {record['room_positions']} positions, "
                f"{record['rows']} rows: preemptions {record['generate_preemptions']} "
                f"(generate) {record['served_preemptions']} (served); equal alone: tokens "
                f"{record['generate_tokens_equal_alone']}/{record['served_tokens_equal_alone']}"
                f", bits {record['generate_bits_equal_alone']}/"
                f"{record['served_bits_equal_alone']} of {record['requests']} (generate/"
                f"served); alone {record['alone_s']:.0f} s, together {record['together_s']:.0f} s",
                flush=True,
            )
    print("saved", save("preemption", torch.device("cpu"), {"records": records}))


if __name__ == "__main__":
    main()
