"""Real chats against `offload serve`, as a vLLM user sends them: greedy, non-streamed, each
answer ending at its own EOS (no `ignore_eos`), `max_tokens` 24, through the openai client.

    python benchmarks/serve_chats.py [--model PATH] [--flags ...] [--rounds 3]
                                     [--concurrency 8 16] [--turns]

One server (`python -m offload.cli serve [MODEL] <flags>`: with neither, the default model
on the default setting), started once; after 2 warm-up chats, for each N in --concurrency:
the first N prompts of `serve.PROMPTS` one after another (one client), then all N at once
(N clients, one chat each; each client is made before the clock starts, as a user keeps
one), --rounds times each; the medians of the wall times and their
ratio beside issue 50's targets (8 at once in <= 1/3 of the time one after another; 16 at
once >= 5x faster). Answers are compared: each prompt's text at once against one after
another, and across rounds.

--turns adds a multi-turn workload: 4 conversations, each with its own ~400-token system
prompt (the same rules after a first line of its own, so that no first turn finds another's
prompt cached), two turns each, streamed; each turn's time to first token (the second
turn's prompt holds the first turn's whole text) and their ratio beside issue 50's target
(turn 2 in <= 1/4 of turn 1's time). Where the server reports vLLM's prefix-cache counters in
/metrics, their deltas are recorded (the hit rate). Each turn's answer is saved: a run with
`--flags --no-enable-prefix-caching` gives the answers to compare them with.

The clients run on the server's machine; the load average before and after is recorded.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import openai
import torch

sys.path.insert(0, str(Path(__file__).parent))
import common
from serve import PROMPTS, SERVED_NAME, default_server, running, scrape, steps_settled

MAX_TOKENS = 24
TARGETS = {8: ("<=", 1 / 3), 16: (">=", 5.0)}  # N: (how, ratio of wall times / speed-up)
SYSTEM = (
    "You are a careful assistant for a travel agency. Answer briefly and politely. "
    + " ".join(
        f"Rule {i}: when a customer asks about destination {i}, mention the season, the "
        "currency, one landmark and one local dish, and never invent prices."
        for i in range(1, 13)
    )
)
QUESTIONS = [
    ("Where should I go in spring?", "And what should I pack?"),
    ("Is Lisbon expensive?", "What dish should I try there?"),
    ("Recommend a city for museums.", "How many days do I need?"),
    ("I like mountains. Any idea?", "Is it safe to hike alone?"),
]
PREFIX_COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=600, max_retries=0)


def chat(talker: openai.OpenAI, prompt: str) -> tuple[str, str]:
    reply = talker.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    choice = reply.choices[0]
    return choice.message.content or "", choice.finish_reason or ""


def one_after_another(url: str, prompts: list[str]) -> tuple[float, list[tuple[str, str]]]:
    talker = client(url)  # (one client, as a user keeps one: its making is not timed)
    started = time.perf_counter()
    answers = [chat(talker, prompt) for prompt in prompts]
    return time.perf_counter() - started, answers


def all_at_once(url: str, prompts: list[str]) -> tuple[float, list[tuple[str, str]]]:
    answers: list[tuple[str, str] | None] = [None] * len(prompts)
    errors: list[BaseException] = []
    ready = threading.Barrier(len(prompts) + 1)

    def run(index: int) -> None:
        talker = client(url)  # (~20 ms of TLS set-up each, before the clock starts)
        ready.wait()
        try:
            answers[index] = chat(talker, prompts[index])
        except BaseException as error:  # (reported after the run)
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    ready.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    return wall, [a for a in answers if a is not None]


def bench_concurrency(url: str, n: int, rounds: int) -> dict:
    prompts = PROMPTS[:n]
    alone, together, texts = [], [], []
    for _ in range(rounds):
        wall, answers = one_after_another(url, prompts)
        alone.append(wall)
        texts.append(answers)
        wall, answers = all_at_once(url, prompts)
        together.append(wall)
        texts.append(answers)
    first = texts[0]
    differing = sorted({i for answers in texts for i, a in enumerate(answers) if a != first[i]})
    ratio = statistics.median(together) / statistics.median(alone)
    how, target = TARGETS.get(n, ("", None))
    return {
        "n": n,
        "one_after_another_s": alone,
        "all_at_once_s": together,
        "median_one_after_another_s": statistics.median(alone),
        "median_all_at_once_s": statistics.median(together),
        "time_ratio": ratio,
        "speedup": 1 / ratio,
        "target": None if target is None else f"{how} {target:.2f}",
        "finish_reasons": sorted({reason for _, reason in first}),
        "tokens_equal": not differing,
        "prompts_whose_answer_changed": differing,
        "answers": [text for text, _ in first],
    }


def stream_ttft(talker: openai.OpenAI, messages: list[dict]) -> tuple[float, str]:
    started = time.perf_counter()
    first, text = None, []
    stream = talker.chat.completions.create(
        model=SERVED_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - started
            text.append(chunk.choices[0].delta.content)
    return (first if first is not None else time.perf_counter() - started), "".join(text)


def bench_turns(url: str) -> dict:
    before = scrape(url) or {}
    talker = client(url)  # (one client for every turn, as a user keeps one: made untimed)
    turns = []
    for number, (first_question, second_question) in enumerate(QUESTIONS):
        messages = [
            {"role": "system", "content": f"You work at agency number {number}. {SYSTEM}"},
            {"role": "user", "content": first_question},
        ]
        ttft_1, answer = stream_ttft(talker, messages)
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": second_question},
        ]
        ttft_2, answer_2 = stream_ttft(talker, messages)
        turns.append({"ttft_turn_1_s": ttft_1, "ttft_turn_2_s": ttft_2, "ratio": ttft_2 / ttft_1})
        turns[-1]["answers"] = [answer, answer_2]  # (against a server without the cache)
    after = scrape(url) or {}
    counters = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in PREFIX_COUNTERS}
    queries, hits = (counters[name] for name in PREFIX_COUNTERS)
    return {
        "system_prompt_words": len(SYSTEM.split()),
        "turns": turns,
        "median_ttft_turn_1_s": statistics.median(t["ttft_turn_1_s"] for t in turns),
        "median_ttft_turn_2_s": statistics.median(t["ttft_turn_2_s"] for t in turns),
        "median_ratio": statistics.median(t["ratio"] for t in turns),
        "target_ratio": "<= 0.25",
        "prefix_cache": counters if queries else None,
        "prefix_hit_rate": hits / queries if queries else None,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model folder or .gguf (default: the default model)")
    parser.add_argument("--flags", nargs=argparse.REMAINDER, default=[], help="to `offload serve`")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--turns", action="store_true", help="the multi-turn workload too")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    server = default_server(args.model, args.flags, "serve-chats")
    command = server.command
    payload: dict[str, object] = {
        "command": command[1:],
        "max_tokens": MAX_TOKENS,
        "rounds": args.rounds,
        "loadavg_before": os.getloadavg(),
    }
    with running(server):
        payload["startup_s"] = server.startup_s
        for prompt in PROMPTS[:2]:  # warm-up
            chat(client(server.url), prompt)
        steps_settled(server.url)  # (compiled steps loaded or compiled)
        runs = []
        for n in args.concurrency:
            row = bench_concurrency(server.url, n, args.rounds)
            runs.append(row)
            print(
                f"N={n:>2}: one after another {row['median_one_after_another_s']:6.2f} s, "
                f"all at once {row['median_all_at_once_s']:6.2f} s: ratio "
                f"{row['time_ratio']:.2f} ({row['speedup']:.2f}x; target {row['target']}), "
                f"answers {'equal' if row['tokens_equal'] else 'CHANGED'}, "
                f"finish {row['finish_reasons']}"
            )
        payload["runs"] = runs
        if args.turns:
            turns = bench_turns(server.url)
            payload["turns"] = turns
            print(
                f"turns: TTFT turn 1 {turns['median_ttft_turn_1_s']:.2f} s, turn 2 "
                f"{turns['median_ttft_turn_2_s']:.2f} s (median ratio "
                f"{turns['median_ratio']:.2f}, target <= 0.25), prefix hit rate "
                f"{turns['prefix_hit_rate']}"
            )
    payload["server_exit"] = server.exit
    payload["loadavg_after"] = os.getloadavg()
    path = common.save("serve-chats", torch.device("cpu"), payload)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
