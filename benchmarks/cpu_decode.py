"""`LLM`'s CPU decode step against llama.cpp on the same float32 bytes (issue 28).

The default model in float32 (`LLM(dtype="float32")`: its compiled step, at every batch
size here), resident and with the disk tier (every layer streamed, warm), and resident eager
(`enforce_eager=True`: every batch size eager, as before the compiled step), against
llama.cpp (`llama-cpp-python`, same threads) on an F32 GGUF of the same weights (written
once into the cache folder, `offload.bench.llama_cpp.write_f32`, as `offload bench` runs
it); and the default model as stored (Q4_1, Q8_0; batch 1 and 8, compiled and eager) against
llama.cpp on the shipped GGUF file. Batch 1 (and our batches 8 and 32), 32 tokens, decode time only (the
time of a 1-token call taken off), medians of interleaved rounds; beside each figure the read
bound: the weights' bytes over the two-thread read rate (its median, measured after each round). Then the
compiled step's compile time in fresh processes: first with empty caches, then twice
loading the step it kept on disk, then traced again with only inductor's kernels cached.

    python benchmarks/cpu_decode.py [--rounds 5] [--tokens 32]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import common
from cpu_step import read_gb_per_s

from offload import LLM, SamplingParams
from offload.bench.llama_cpp import write_f32
from offload.model.default import gguf_path

PROMPT = "What is the capital of France? Answer in one sentence, then say why."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    ours = {
        "resident": LLM(dtype="float32", device="cpu"),
        "disk tier (warm)": LLM(dtype="float32", device="cpu", cpu_memory_gb=0),
        "resident, eager": LLM(dtype="float32", device="cpu", enforce_eager=True),
    }
    # The default model as stored (Q4_1, Q8_0): compiled, and eager; llama.cpp
    # on the same GGUF file.
    stored = {
        "as stored": LLM(device="cpu"),
        "as stored, eager": LLM(device="cpu", enforce_eager=True),
    }
    llama = _llama_cpp(write_f32(gguf_path()))
    llama_q4 = _llama_cpp(gguf_path())
    runs = {f"{name} b{b}": (llm, b) for name, llm in ours.items() for b in (1, 8, 32)}
    runs.update({f"{name} b{b}": (llm, b) for name, llm in stored.items() for b in (1, 8)})
    rates: dict[str, list[float]] = {name: [] for name in runs}
    rates["llama.cpp b1"], rates["llama.cpp Q4_1 b1"] = [], []
    for llm, batch in runs.values():  # warm-up
        _ours_rate(llm, batch, 4)
    reads = []  # the read rate, measured after each round: the bound of the same moments
    for _ in range(args.rounds):
        for name, (llm, batch) in runs.items():
            rates[name].append(_ours_rate(llm, batch, args.tokens))
        if llama is not None:
            rates["llama.cpp b1"].append(_llama_rate(llama, ours["resident"], args.tokens))
            rates["llama.cpp Q4_1 b1"].append(_llama_rate(llama_q4, ours["resident"], args.tokens))
        reads.append(read_gb_per_s())
    weight_bytes = sum(p.numel() * p.element_size() for p in ours["resident"].model.parameters())
    for llm in [*ours.values(), *stored.values()]:
        llm.close()
    read = statistics.median(reads)
    bound = read * 1e9 / weight_bytes
    llama_rate = statistics.median(rates["llama.cpp b1"]) if rates["llama.cpp b1"] else None
    print(f"{args.tokens} tokens, {args.rounds} rounds, threads {torch.get_num_threads()}; read "
          f"{read:.1f} GB/s: batch-1 bound {bound:.1f} tok/s for {weight_bytes / 1e6:.0f} MB")  # fmt: skip
    results = {}
    for name, values in rates.items():
        if not values:
            print(f"{name:>22}: skipped (llama-cpp-python is not installed)")
            continue
        rate = statistics.median(values)
        batch = int(name.rsplit("b", 1)[1])
        results[name] = {"tokens_per_s": rate, "round_tokens_per_s": values, "batch": batch}
        if "stored" in name or "Q4_1" in name:  # (other bytes: against llama.cpp's Q4_1)
            q4 = rates["llama.cpp Q4_1 b1"]
            versus = f" ({rate / statistics.median(q4):.2f}x llama.cpp's Q4_1)" if q4 else ""
            versus = versus if batch == 1 else ""
            print(f"{name:>22}: {rate:7.1f} tok/s{versus}")
            continue
        versus = f", {rate / llama_rate:.2f}x llama.cpp" if llama_rate and batch == 1 else ""
        of_bound = f" ({rate / bound:.2f} of the bound{versus})" if batch == 1 else ""
        print(f"{name:>22}: {rate:7.1f} tok/s{of_bound}")
    payload = {"tokens": args.tokens, "rounds": args.rounds, "threads": torch.get_num_threads(),
               "read_gb_per_s": read, "round_read_gb_per_s": reads,
               "weight_bytes": weight_bytes, "bound_tokens_per_s": bound,
               "results": results, "compile_s": _compile_times()}  # fmt: skip
    print(f"saved {common.save('cpu-decode', torch.device('cpu'), payload)}")


def _ours_rate(llm: LLM, batch: int, tokens: int) -> float:
    """Decode tok/s of `batch` copies of the prompt: `tokens` tokens less one token's call."""
    prompts = [PROMPT] * batch
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    many = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    llm.generate(prompts, one, use_tqdm=False)
    prefill = time.perf_counter() - started
    started = time.perf_counter()
    llm.generate(prompts, many, use_tqdm=False)
    return batch * (tokens - 1) / (time.perf_counter() - started - prefill)


_ONE_STEP = (
    "from offload import LLM, SamplingParams; LLM(dtype='float32', device='cpu'{}).generate("
    "'Hi', SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)"
)


def _compile_times() -> dict[str, float]:
    """Seconds the compiled step took to be ready in a fresh process (as the step reports
    it on stderr): with empty caches (inductor's and the kept steps'), then twice loading
    the step kept on disk, then once with the kept step gone (traced again; inductor's
    kernels from its cache); then the disk tier's step (its first process, inductor's
    cache warm from the resident runs), and loading the step it kept."""
    times = {}
    with tempfile.TemporaryDirectory() as folder:
        # (a cache folder of its own: the first process converts the model there. Links to
        # the user's entries are refused: the cache's key and what it signed are never
        # followed through a link, `memory/cache_trust`)
        ours = Path(folder) / "offload"
        ours.mkdir(mode=0o700)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": folder + "/inductor"}
        env["OFFLOAD_CACHE_DIR"] = str(ours)
        env["OFFLOAD_CPU_COMPILE"] = "wait"  # (the step made before the first token: timed)
        names = ("cold", "kept step", "kept step again", "traced, kernels cached")
        names += ("disk tier, first", "disk tier, kept step")
        for name in names:
            if name in ("traced, kernels cached", "disk tier, first"):
                for kept in (ours / "compiled-steps").iterdir():
                    kept.unlink()
            setting = ", cpu_memory_gb=0" if name.startswith("disk") else ""
            err = subprocess.run(
                [sys.executable, "-c", _ONE_STEP.format(setting)],
                env=env,
                capture_output=True,
                text=True,
            ).stderr
            found = re.search(r"decode step ready in ([0-9.]+) s", err)
            times[name] = float(found[1]) if found else float("nan")
            print(f"{'compile, ' + name:>30}: {times[name]:7.1f} s")
    return times


def _llama_cpp(path: Path):
    try:
        import llama_cpp
    except ImportError:
        return None
    threads = torch.get_num_threads()
    return llama_cpp.Llama(model_path=str(path), n_ctx=256, n_batch=256, n_threads=threads,
                           n_threads_batch=threads, verbose=False)  # fmt: skip


def _llama_rate(llama, ours: LLM, tokens: int) -> float:
    import llama_cpp

    ids = ours.tokenizer(PROMPT)["input_ids"]
    llama.reset()
    llama.eval(ids)
    vocab = llama.n_vocab()

    def greedy() -> int:
        logits = llama_cpp.llama_get_logits(llama.ctx)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(vocab,))))

    chosen = [greedy()]
    started = time.perf_counter()
    for _ in range(tokens - 1):
        llama.eval(chosen[-1:])
        chosen.append(greedy())
    return (tokens - 1) / (time.perf_counter() - started)


if __name__ == "__main__":
    main()
