"""One run of `scale.py`, alone in a fresh process so that its peak RSS is its own:

    python benchmarks/scale_child.py '<json spec>'

The spec names the model, the method ("llm": `offload.LLM(model, **flags)`;
"accelerate": accelerate's `device_map` with `max_memory={"cpu": budget}` through
`offload.bench`'s method), the prompt, the answer's length and the rounds. Printed last,
one line: `SCALE-RESULT {json}` with the process's RSS after its imports, its peak
(`VmHWM` just before it exits, and after each stage), the load time, the first calls'
times (a compile among them is said: `compile_s`), then per round the time to first token
(a 1-token answer: prompt in, first token out) and the decode rate ((N - 1) tokens over
an N-token answer's time less that), the greedy tokens, and the bytes each forward read
from disk or computed on in mapped files.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch  # (imported before the baseline is read: what every process pays)
import transformers

import offload  # noqa: F401

MARK = "SCALE-RESULT "


def memory() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0]) * 1024
    return found


def timed(fn):
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


def run_llm(spec: dict, result: dict) -> None:
    from offload import LLM, SamplingParams

    num_tokens = spec["max_tokens"]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    answer = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    # (the rounds repeat one prompt: without this its time to first token would time a
    # prefix-cache hit, one token, not the prefill a new prompt pays)
    flags = {"enable_prefix_caching": False, **spec["flags"]}
    result["load_s"], llm = timed(lambda: LLM(spec["model"], progress=False, **flags))
    result["peak_after_load_bytes"] = memory()["VmHWM"]
    result["offloader"] = type(llm.offloader).__name__
    result["offloaded_bytes"] = int(llm.offloader.offloaded_bytes)
    overhead = getattr(llm, "fixed_overhead", None)  # what generate's figures line states
    result["stated_overhead_bytes"] = overhead.total_bytes if overhead is not None else None

    def generate(params):
        return llm.generate(spec["prompt"], params, use_tqdm=False)[0].outputs[0]

    # The first prefill, then the first whole answer: its first decode step compiles
    # (or loads a kept step), and a streamed answer holds its first token until then.
    result["first_prefill_s"], _ = timed(lambda: generate(one))
    before = llm.transfer_stats()
    result["first_answer_s"], first = timed(lambda: generate(answer))
    result["compile_s"] = (llm.transfer_stats() - before).compile_s
    result["first_token_wait_s"] = result["first_prefill_s"] + result["compile_s"]
    result["peak_after_first_bytes"] = memory()["VmHWM"]
    result["tokens"], result["text"] = list(first.token_ids), first.text
    # The rounds measure the steady state: the steps compiling in the background (the
    # default) are waited for first; the first answer above is what a user waits for.
    result["compile_wait_s"], _ = timed(llm.wait_for_compiles)
    ttft, answers, before = [], [], llm.transfer_stats()
    for _ in range(spec["rounds"]):
        ttft.append(timed(lambda: generate(one))[0])
        answer_s, out = timed(lambda: generate(answer))
        answers.append(answer_s)
        result["same_tokens_each_round"] = list(out.token_ids) == result["tokens"]
        result["steady_tokens"] = list(out.token_ids)
    # Decode: the N - 1 steps after the first token, in the median answer's time less the
    # median first token's (medians first: on a tiny model one round's difference is noise).
    decode_s = statistics.median(answers) - statistics.median(ttft)
    result["median_decode_tok_s"] = (num_tokens - 1) / decode_s if decode_s > 0 else None
    result["answer_s"], result["median_answer_tok_s"] = (
        answers,
        num_tokens / statistics.median(answers),
    )
    moved = llm.transfer_stats() - before
    forwards = max(moved.num_forwards, 1)
    result["disk_read_bytes_per_forward"] = moved.disk_read_bytes / forwards
    result["mapped_bytes_per_forward"] = moved.disk_mapped_bytes / forwards
    result["copied_bytes_per_forward"] = moved.weight_copied_bytes / forwards
    result["disk_read_gb_per_s"] = moved.disk_read_gb_per_s
    result["compiled_steps"] = moved.num_compiled_steps
    result["ttft_s"] = ttft
    llm.close()


def run_accelerate(spec: dict, result: dict) -> None:
    """offload bench's accelerate method (`AccelerateMap`), its max_memory the budget."""
    from offload.bench.peers import AccelerateMap
    from offload.bench.workload import Workload, prepare

    class BudgetMap(AccelerateMap):
        name = "accelerate-budget"

        def max_memory(self):
            return {"cpu": int(spec["budget_gib"] * 2**30)}

    tokenizer = transformers.AutoTokenizer.from_pretrained(spec["model"])
    ids = torch.tensor([tokenizer(spec["prompt"]).input_ids])  # [1, prompt_len]
    workload = Workload(model=spec["model"], device="cpu", batch_sizes=(1,),
                        prompt_len=ids.shape[1], output_len=spec["max_tokens"],
                        rounds=spec["rounds"])  # fmt: skip
    method = BudgetMap(prepare(workload))
    result["load_s"], _ = timed(method.load)
    result["peak_after_load_bytes"] = memory()["VmHWM"]
    result["bytes_by_place"] = dict(method.bytes_by_place)
    result["first_answer_s"], first = timed(lambda: method.run(ids))
    result["first_prefill_s"] = result["first_token_wait_s"] = first.prefill_s
    result["peak_after_first_bytes"] = memory()["VmHWM"]
    result["tokens"] = first.tokens[0].tolist()
    result["text"] = tokenizer.decode(result["tokens"], skip_special_tokens=True)
    ttft, decode = [], []
    for _ in range(spec["rounds"]):
        decoded = method.run(ids)
        ttft.append(decoded.prefill_s)
        decode.append(len(decoded.step_s) / sum(decoded.step_s))
        result["same_tokens_each_round"] = decoded.tokens[0].tolist() == result["tokens"]
    result["ttft_s"], result["decode_tok_s"] = ttft, decode
    method.close()


def main() -> None:
    spec = json.loads(sys.argv[1])
    result: dict = {"baseline_rss_bytes": memory()["VmRSS"], "threads": torch.get_num_threads()}
    try:
        (run_accelerate if spec["method"] == "accelerate" else run_llm)(spec, result)
    except Exception as error:  # a failure at this size is a finding: recorded, not fatal
        result["error"] = f"{type(error).__name__}: {error}"
        result["traceback"] = traceback.format_exc(limit=6)
    for key in ("ttft_s", "decode_tok_s"):  # (the LLM's decode rate is set above)
        if result.get(key):
            result[f"median_{key}"] = statistics.median(result[key])
    result["peak_rss_bytes"] = memory()["VmHWM"]
    print(MARK + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
