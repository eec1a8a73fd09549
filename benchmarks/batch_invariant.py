"""What batch invariance costs (`LLM(batch_invariant=True)`, vLLM's VLLM_BATCH_INVARIANT=1):
`generate` of one prompt and of a batch of mixed-length prompts, default against invariant,
on the default model as stored and in float32 (`--forms`: bfloat16 too), resident or with
`--cpu-offload-gb` streamed; the batch's prefill alone (one token each: every prompt
prefills as it would alone, in both modes); and whether each prompt's tokens are the same
alone and in the batch (the default's may differ, the invariant's must not).

Each setting in a fresh LLM; one warm-up call, then `--repeats` timed calls, the median
kept (the compiled steps of the default are waited for first: the steady state). Run:
`python benchmarks/batch_invariant.py` (`--model PATH`: a checkpoint at real size, as stored);
results JSON in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from common import save

from offload import LLM, SamplingParams

LENGTHS = (3, 9, 17, 30, 44, 61, 80, 120)  # the batch's prompt lengths, in tokens


def _prompts(vocab: int) -> list[dict]:
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(n)]} for n in LENGTHS]


def _timed(llm: LLM, prompts, params, repeats: int) -> tuple[float, list]:
    llm.generate(prompts, params, use_tqdm=False)  # warm-up (and compiles, waited for below)
    llm.wait_for_compiles()
    seconds, outputs = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), outputs


def _tokens(output) -> list[int]:
    return list(output.outputs[0].token_ids)


def run(form: str, invariant: bool, args) -> dict:
    kwargs = {} if form == "stored" else {"dtype": form}
    if args.model:  # (a checkpoint of the user's, as stored: `form` only names the row)
        kwargs = {"model": args.model}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    if args.cpu_offload_gb:
        kwargs["cpu_offload_gb"] = args.cpu_offload_gb
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    # (no prefix caching in either mode: the calls repeat their prompts, and a hit would
    # time and compare a one-token prefill)
    kwargs["enable_prefix_caching"] = False
    with LLM(batch_invariant=invariant, max_model_len=512, **kwargs) as llm:
        prompts = _prompts(llm.model.config.vocab_size)
        prefill_s, _ = _timed(llm, prompts, first, args.repeats)
        one_s, _ = _timed(llm, prompts[3:4], params, args.repeats)
        batch_s, together = _timed(llm, prompts, params, args.repeats)
        alone = [_tokens(llm.generate([p], params, use_tqdm=False)[0]) for p in prompts]
    tokens = args.max_tokens * len(prompts)
    same = sum(a == _tokens(o) for a, o in zip(alone, together, strict=True))
    return {
        "form": form,
        "model": args.model,
        "batch_invariant": invariant,
        "cpu_offload_gb": args.cpu_offload_gb,
        "batch_prefill_s": prefill_s,
        "one_prompt_s": one_s,
        "one_prompt_tok_s": args.max_tokens / one_s,
        "batch_s": batch_s,
        "batch_tok_s": tokens / batch_s,
        "prompts_same_alone_and_batched": same,
        "prompts": len(prompts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forms", nargs="+", default=["stored", "float32"])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpu-offload-gb", type=float, default=0.0)
    parser.add_argument("--modes", nargs="+", default=["default", "invariant"])
    parser.add_argument(
        "--model", help="a checkpoint to run as stored (e.g. scale.py's random models)"
    )
    args = parser.parse_args()
    rows = []
    print(
        f"{'form':8} {'mode':10} {'8 prefills s':>12} {'1 prompt tok/s':>15} "
        f"{'8 prompts tok/s':>16} {'same':>6}"
    )
    for form in args.forms:
        for mode in args.modes:
            row = run(form, mode == "invariant", args)
            rows.append(row)
            print(
                f"{form:8} {mode:10} {row['batch_prefill_s']:12.2f} {row['one_prompt_tok_s']:15.1f} "
                f"{row['batch_tok_s']:16.1f} {row['prompts_same_alone_and_batched']:>3}/{row['prompts']}",
                flush=True,
            )
    for form in args.forms if len(args.modes) == 2 else ():
        base, inv = (r for r in rows if r["form"] == form)
        print(
            f"{form}: invariant/default one prompt {inv['one_prompt_tok_s'] / base['one_prompt_tok_s']:.2f}x, "
            f"batch {inv['batch_tok_s'] / base['batch_tok_s']:.2f}x"
        )
    import torch

    path = save("batch-invariant", torch.device("cpu"), {"rows": rows})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
