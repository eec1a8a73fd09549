"""Whether a prompt's answer depends on how its prompt was cut: 9 chat-like prompts, most
sharing a 60-token system text, answered greedily (12 tokens, logprobs), compared bit for
bit with each one's answer alone on an engine without prefix caching:

  batch+prefix  all 9 in one `generate` with prefix caching on (the default): some find
                the system text held by another
  again         the 9 again, in reverse order: every prompt held whole but its last token
  chunked16     all 9 with `max_num_batched_tokens=16` (`--chunk`): prompts cut into chunks
                of 16 tokens riding in the running rows' decode steps

    python benchmarks/prompt_cuts.py [--forms stored float32 bfloat16] [--eager] [--chunk 16]

Results: benchmarks/results/prompt-cuts-cpu-<date>.json (machine, date, counts per form).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common
import torch

from offload import LLM, SamplingParams

SYSTEM = "You are a careful assistant. Answer in one short sentence and add nothing else. " * 3
QUESTIONS = [
    "What is the capital of France?",
    "Write a word about the number 3.",
    "Name three colours.",
    "Why is the sky blue?",
    "Count from one to five.",
    "What is two plus two?",
]
PROMPTS = [SYSTEM + q for q in QUESTIONS] + QUESTIONS[:2] + [SYSTEM * 2 + "Say hi."]
PARAMS = SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)


def answer(output) -> tuple:
    completion = output.outputs[0]
    logprobs = [{t: lp.logprob for t, lp in step.items()} for step in completion.logprobs]
    return completion.token_ids, logprobs


def runs(form: str, eager: bool, chunk: int) -> dict[str, list]:
    kwargs = {} if form == "stored" else {"dtype": form}
    kwargs |= {"max_model_len": 512, "enforce_eager": eager}
    out = {}
    with LLM(enable_prefix_caching=False, **kwargs) as llm:
        out["alone"] = [answer(llm.generate([p], PARAMS, use_tqdm=False)[0]) for p in PROMPTS]
    with LLM(**kwargs) as llm:
        out["batch+prefix"] = [answer(o) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        again = llm.generate(PROMPTS[::-1], PARAMS, use_tqdm=False)[::-1]
        out["again"] = [answer(o) for o in again]
    with LLM(max_num_batched_tokens=chunk, **kwargs) as llm:
        out[f"chunked{chunk}"] = [answer(o) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--forms", nargs="+", default=["stored", "float32", "bfloat16"])
    parser.add_argument("--eager", action="store_true", help="no compiled decode step")
    parser.add_argument("--chunk", type=int, default=16, help="max_num_batched_tokens")
    args = parser.parse_args()
    rows = []
    for form in args.forms:
        answers = runs(form, args.eager, args.chunk)
        alone = answers.pop("alone")
        for name, got in answers.items():
            tokens = sum(a[0] == b[0] for a, b in zip(got, alone, strict=True))
            bitwise = sum(a == b for a, b in zip(got, alone, strict=True))
            rows.append({"form": form, "run": name, "tokens_equal": tokens, "bitwise": bitwise})
            print(
                f"{form:9} {'eager' if args.eager else 'compiled'} {name:13} tokens "
                f"{tokens}/{len(PROMPTS)}, tokens and logprobs bit for bit {bitwise}/{len(PROMPTS)}",
                flush=True,
            )
    payload = {"eager": args.eager, "chunk": args.chunk, "prompts": len(PROMPTS), "rows": rows}
    print("saved", common.save("prompt-cuts", torch.device("cpu"), payload))


if __name__ == "__main__":
    main()
