"""How often a request served in a continuous batch gets the greedy answer it would get
alone, and whether offloading changes a single bit of what the server answers.

    python benchmarks/serve_exactness.py [--max-tokens 32] [--model PATH] [--dtype float32]
        [--clients 16]

1. Each of the serving benchmark's 16 chat prompts alone through `LLM.chat` (greedy).
2. The same 16 (repeated to `--clients`) through a server's stream from as many threads
   that start 0-50 ms apart (so they join a running batch at different steps, and hit
   the system prompt held by whoever came first, as clients do): how many got the tokens
   of (1), and how many its tokens and logprobs bit for bit (the promise on a CPU).
3. The 16 queued at once (one schedule, whatever the timing) on a resident server, one with
   every decoder layer prefetched, and one with every decoder layer read from the disk
   tier: tokens and logprobs must be bitwise equal (the promise), and bytes must move.
`--dtype float32` (the default model de-quantized) runs the servers' compiled CPU step
(`rows.RowStep`): the JSON records how many decode steps were compiled in each.
"""

from __future__ import annotations

import argparse
import queue
import random
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common
from serve import PROMPTS

from offload import SamplingParams
from offload.llm.chat import chat_token_ids
from offload.llm.llm import LLM
from offload.model.default import default_model_path

SETTINGS = {
    "resident": {},
    "prefetch": {"offload_group_size": 1, "offload_prefetch_step": 2},
    "disk": {"cpu_memory_gb": 0, "disk_io": "direct"},
}


def prompt_ids(llm: LLM) -> list[list[int]]:
    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    return chat_token_ids(
        llm.tokenizer, messages, chat_template=None, add_generation_prompt=True,
        continue_final_message=False, tools=None, chat_template_kwargs=None,
    )[1]  # fmt: skip


def answer(output) -> tuple:
    """A completion's tokens and the logprobs of each step."""
    completion = output.outputs[0]
    logprobs = [{t: lp.logprob for t, lp in e.items()} for e in completion.logprobs or []]
    return completion.token_ids, logprobs


def staggered(llm: LLM, ids: list[list[int]], params: SamplingParams) -> list[tuple]:
    serving, results = llm.serving(max_num_seqs=len(ids)), [None] * len(ids)
    delays = [random.Random(i).uniform(0, 0.05) for i in range(len(ids))]

    def client(index: int) -> None:
        threading.Event().wait(delays[index])
        for output in serving.stream(None, ids[index], params):
            results[index] = answer(output)

    common.in_threads(client, len(ids))
    return results


def together(llm: LLM, ids: list[list[int]], params: SamplingParams) -> list:
    serving = llm.serving(max_num_seqs=16)
    outputs = [queue.Queue() for _ in ids]
    requests = [serving.prepare(None, i, params, q.put) for i, q in zip(ids, outputs, strict=True)]
    serving.core.submit_all(requests)
    finals = []
    for q in outputs:
        while not (item := q.get()).finished:
            pass
        completion = item.outputs[0]
        logprobs = [{t: lp.logprob for t, lp in e.items()} for e in completion.logprobs]
        finals.append((completion.token_ids, logprobs))
    return finals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--clients", type=int, default=16, help="staggered clients (the 16 prompts repeated)"
    )
    args = parser.parse_args()
    model = args.model or str(default_model_path())
    with_logprobs = SamplingParams(
        temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=2
    )
    with LLM(model, dtype=args.dtype) as llm:  # (prefix caching on: the system prompt held)
        ids = prompt_ids(llm)
        alone = [
            answer(llm.generate([{"prompt_token_ids": i}], with_logprobs, use_tqdm=False)[0])
            for i in ids
        ]
        clients = [ids[i % len(ids)] for i in range(args.clients)]
        joined = staggered(llm, clients, with_logprobs)
    expected = [alone[i % len(ids)] for i in range(args.clients)]
    same = sum(a[0] == b[0] for a, b in zip(expected, joined, strict=True))
    bitwise_alone = sum(a == b for a, b in zip(expected, joined, strict=True))
    print(f"{same}/{args.clients} prompts served in a running batch got their tokens alone; "
          f"{bitwise_alone}/{args.clients} their tokens and logprobs bit for bit")  # fmt: skip
    answers, moved, compiled = {}, {}, {}
    for name, flags in SETTINGS.items():
        with LLM(model, dtype=args.dtype, **flags) as llm:
            answers[name] = together(llm, ids, with_logprobs)
            stats = llm.offloader.stats()
            moved[name] = stats.bytes_copied + stats.disk.bytes_read
            compiled[name] = llm.transfer_stats().num_compiled_steps
    bitwise = {name: answers[name] == answers["resident"] for name in SETTINGS}
    for name in SETTINGS:
        print(f"{name}: bitwise the resident server's tokens and logprobs: {bitwise[name]}; "
              f"weight bytes moved {moved[name] / 2**20:.0f} MiB; "
              f"{compiled[name]} compiled decode steps")  # fmt: skip
    path = common.save("serve-exactness", torch.device("cpu"), {
        "model": model, "dtype": args.dtype, "max_tokens": args.max_tokens, "prompts": len(ids),
        "compiled_steps": compiled,
        "clients": args.clients, "same_as_alone": same, "bitwise_as_alone": bitwise_alone,
        "bitwise_equal_to_resident": bitwise, "bytes_moved": moved,
    })  # fmt: skip
    print(f"saved {path}")


if __name__ == "__main__":
    main()
