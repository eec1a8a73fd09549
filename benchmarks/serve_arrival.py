"""A long prompt arriving while streams decode (issue 50's chunked-prefill check): do the
running streams keep their pace?

    python benchmarks/serve_arrival.py [--model PATH] [--streams 8] [--prompt-tokens 2000]
                                       [--rounds 3] [--stream-tokens 4000] [--flags ...]

One `offload serve` (the default model on its default setting, plus --flags), warmed up
until its batched decode steps run compiled (`warm_up`). Each round:
--streams streaming completions (greedy, `ignore_eos`, long enough to outlast the round)
run until each has 10 tokens; then one completion of about --prompt-tokens tokens
(`max_tokens` 1; its own words each round) arrives, and the round ends 1 s after it is answered. Client-side, each
stream's inter-token gaps (between token chunks) are split into before the arrival and
during it (from its sending to its answer). Reported per round: the median gap before, the
median and p99 of the gaps during, the long prompt's time to answer, and p99 during over
the median before beside the target (<= 3: the streams keep their pace). Medians over the
rounds are saved with the machine and date.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import threading
import time
from pathlib import Path

import openai
import torch

sys.path.insert(0, str(Path(__file__).parent))
import common
from serve import SERVED_NAME, default_server, running, scrape, steps_settled

TARGET = 3.0


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def stream_times(
    url: str, prompt: str, stop: threading.Event, times: list[float], max_tokens: int
) -> None:
    """Stream greedy tokens until `stop`; the arrival time of each token chunk."""
    stream = client(url).completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices:
            times.append(time.perf_counter())
        if stop.is_set():
            stream.close()
            return


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def one_round(url: str, streams: int, prompt_tokens: int, index: int, max_tokens: int) -> dict:
    stop = threading.Event()
    times: list[list[float]] = [[] for _ in range(streams)]
    threads = [
        threading.Thread(target=stream_times, args=(url, f"t{i} story", stop, times[i], max_tokens))
        for i in range(streams)
    ]
    for thread in threads:
        thread.start()
    while min(len(t) for t in times) < 10:
        time.sleep(0.05)
    # (its own words each round: a prompt seen before would be a prefix cache hit)
    long_prompt = f"round {index}: " + " ".join(["the"] * (prompt_tokens - 4))
    sent = time.perf_counter()
    client(url).completions.create(
        model=SERVED_NAME, prompt=long_prompt, max_tokens=1, temperature=0
    )
    answered = time.perf_counter()
    time.sleep(1.0)
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    before, during = [], []
    for stamps in times:
        for earlier, later in itertools.pairwise(stamps):
            if later <= sent:
                before.append(later - earlier)
            elif earlier < answered:
                during.append(later - earlier)
    median_before = statistics.median(before)
    p99_during = percentile(during, 0.99)
    return {
        "median_gap_before_s": median_before,
        "median_gap_during_s": statistics.median(during),
        "p99_gap_during_s": p99_during,
        "long_prompt_answer_s": answered - sent,
        "p99_during_over_median_before": p99_during / median_before,
    }


def warm_up(url: str, max_tokens: int, limit_s: float = 900.0) -> None:
    """Short rounds until the batches' decode steps run compiled and no step loads or
    compiles in the background any more (the packed step's graph, in which prompts ride,
    comes after them): a first launch compiles them in the background, and meanwhile its
    steps run eagerly and prompts ride in them eagerly or not at all (`mixed_step`), which
    is not the steady state measured here."""
    deadline = time.monotonic() + limit_s
    index = 0
    while True:
        before = (scrape(url) or {}).get("offload:compiled_steps_total", 0.0)
        one_round(url, 2, 64, -1 - index, max_tokens)
        index += 1
        if (scrape(url) or {}).get("offload:compiled_steps_total", 0.0) > before:
            return steps_settled(url, max(deadline - time.monotonic(), 0.0))
        if time.monotonic() > deadline:
            return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model folder or .gguf (default: the default model)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stream-tokens", type=int, default=4000,
                        help="each stream's max_tokens (within the model's context)")  # fmt: skip
    parser.add_argument("--flags", nargs=argparse.REMAINDER, default=[], help="to `offload serve`")
    args = parser.parse_args()
    server = default_server(args.model, args.flags, "serve-arrival")
    command = server.command
    rounds = []
    with running(server):
        warm_up(server.url, args.stream_tokens)
        for index in range(args.rounds):
            row = one_round(server.url, args.streams, args.prompt_tokens, index, args.stream_tokens)
            rounds.append(row)
            print(
                f"gap before {row['median_gap_before_s'] * 1e3:.0f} ms, during: median "
                f"{row['median_gap_during_s'] * 1e3:.0f} ms, p99 "
                f"{row['p99_gap_during_s'] * 1e3:.0f} ms; long prompt answered in "
                f"{row['long_prompt_answer_s']:.2f} s; p99 / median before "
                f"{row['p99_during_over_median_before']:.1f} (target <= {TARGET:.0f})"
            )
    summary = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    payload = {"command": command[1:], "streams": args.streams,
               "prompt_tokens": args.prompt_tokens, "rounds": rounds, "median": summary,
               "target": f"p99 during / median before <= {TARGET}"}  # fmt: skip
    path = common.save("serve-arrival", torch.device("cpu"), payload)
    print(
        f"median p99 / median before {summary['p99_during_over_median_before']:.1f}; saved {path}"
    )


if __name__ == "__main__":
    main()
