"""A prompt's prefill time on a CPU, by weight form and prompt length, beside the machine's
float32 matrix-product bound; and the bits it gives, checked: the same prompt prefilled
after a held prefix of all but its last 16 tokens must give the first token's logprobs of
the whole prefill, bit for bit.

    python benchmarks/prefill.py [--forms stored float32 bfloat16] [--lengths 37 512 2000]
        [--repeats 5] [--model PATH]

Each form loads the model once (eager, no prefix caching for the timed runs), prefills a
prompt of random token ids with `max_tokens=1` after one warm-up, `--repeats` times, and
takes the median. The bound: 2 x the model's linear weights x tokens, at the rate MKL's
float32 product of a 1024 x 2048 by 2048 x 2048 runs here (measured first, median of 5);
attention is not in it. To compare with an earlier commit, run this script with
PYTHONPATH=<that tree>/src (it uses only the public `LLM`).
Results: benchmarks/results/prefill-cpu-<date>.json (machine, date, every run, medians).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common
import torch

from offload import LLM, SamplingParams


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--forms", nargs="+", default=["stored", "float32", "bfloat16"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[37, 512, 2000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--label", default="", help="a name for this run (e.g. a commit)")
    return parser.parse_args()


def gemm_rate() -> float:
    """FLOP/s of MKL's float32 product here (the bound's rate)."""
    x, w = torch.randn(1024, 2048), torch.randn(2048, 2048)
    torch.nn.functional.linear(x, w)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - start)
    return 2 * 1024 * 2048 * 2048 / statistics.median(times)


def linear_params(model: torch.nn.Module) -> int:
    """The weights the model's linears (and their quantized forms) multiply by."""
    return sum(
        getattr(m, "in_features", 0) * getattr(m, "out_features", 0) for m in model.modules()
    )


def prompt(vocab: int, length: int, seed: int) -> dict:
    generator = random.Random(seed)
    return {"prompt_token_ids": [generator.randrange(3, vocab) for _ in range(length)]}


def first_logprobs(llm: LLM, ids: list[int]) -> dict:
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
    return {t: lp.logprob for t, lp in out.logprobs[0].items()}


def held_prefix_check(model: str | None, kwargs: dict, vocab: int) -> bool:
    """Whether a prompt prefilled after a held prefix gives the whole prefill's bits."""
    ids = prompt(vocab, 200, seed=9)["prompt_token_ids"]
    with LLM(model, max_model_len=512, enforce_eager=True, **kwargs) as llm:
        whole = first_logprobs(llm, ids)
        llm.generate(
            [{"prompt_token_ids": ids[:-16]}], SamplingParams(max_tokens=1), use_tqdm=False
        )
        after = first_logprobs(llm, ids)  # (prefix caching: the first 184 tokens held)
    return whole == after


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    rate = gemm_rate()
    print(f"MKL float32 product here: {rate / 1e9:.0f} GFLOP/s (the bound's rate)")
    rows = []
    for form in args.forms:
        kwargs = {} if form == "stored" else {"dtype": form}
        length = max(args.lengths) + 8
        with LLM(
            args.model,
            max_model_len=length,
            enforce_eager=True,
            enable_prefix_caching=False,
            **kwargs,
        ) as llm:
            vocab, params = llm.model.config.vocab_size, linear_params(llm.model.model)
            one = SamplingParams(temperature=0, max_tokens=1)
            for tokens in args.lengths:
                ids = prompt(vocab, tokens, seed=tokens)
                llm.generate([ids], one, use_tqdm=False)  # (warm-up)
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    llm.generate([ids], one, use_tqdm=False)
                    times.append(time.perf_counter() - start)
                median = statistics.median(times)
                bound = 2 * params * tokens / rate
                row = {"form": form, "tokens": tokens, "median_s": median, "times_s": times}
                row |= {"bound_s": bound, "of_bound": bound / median}
                rows.append(row)
                print(
                    f"{form:9} {tokens:5} tokens: {median * 1e3:8.1f} ms  "
                    f"(bound {bound * 1e3:7.1f} ms: {bound / median:.2f} of it)",
                    flush=True,
                )
        same = held_prefix_check(args.model, kwargs, vocab)
        print(f"{form:9} after a held prefix, the whole prefill's logprobs: {same}")
        rows.append({"form": form, "held_prefix_bitwise": same})
    payload = {"label": args.label, "gemm_flops": rate, "rows": rows}
    name = f"prefill-{args.label}" if args.label else "prefill"
    print("saved", common.save(name, torch.device("cpu"), payload))


if __name__ == "__main__":
    main()
