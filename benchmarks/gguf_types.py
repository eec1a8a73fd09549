"""The GGUF types llama.cpp users download, each run as stored by `LLM` against llama.cpp on
the same file and against the file's float32 conversion (issue 27).

The files are made here by llama.cpp itself (`llama-cpp-python`'s `llama_model_quantize`)
from an F32 GGUF of the default model (`offload.bench.llama_cpp.write_f32`), as a user's
Q4_K_M or Q6_K download is made; the default model's 576-wide matrices are not whole
256-value super-blocks, so llama.cpp falls back to Q5_0/Q5_1/Q8_0 for them (a "Q4_K_M" of
it holds Q5_0, Q4_K, Q6_K and Q8_0). Skipped, with the reason, without llama-cpp-python.

For each type: the file's bytes and the bytes `LLM` keeps; batch-1 decode tok/s of `LLM`
(its default: the compiled step), of llama.cpp (same threads), and of `LLM` on the float32
conversion (one figure for all: the same shape); the read bound of the bytes kept (their
size over the two-thread read rate, measured after each round); perplexity on a fixed text
of the stored model, its float32 conversion and llama.cpp. 32 tokens, decode time only,
medians of interleaved rounds.

    python benchmarks/gguf_types.py [--rounds 3] [--tokens 32] [--types Q4_K_M Q6_K ...]
"""

from __future__ import annotations

import argparse
import ctypes
import math
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import common
from cpu_decode import _llama_cpp, _llama_rate, _ours_rate
from cpu_step import read_gb_per_s

from offload import LLM, SamplingParams
from offload.bench.llama_cpp import write_f32
from offload.model.default import gguf_path

TYPES = ("Q4_0", "Q5_1", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K")
# (written for this benchmark)
TEXT = (
    "The river runs past the old mill and under the stone bridge, where children stop to "
    "watch the water. In the autumn the leaves fall into the current and are carried down "
    "to the town, past the market and the church, until they reach the sea. Nobody in the "
    "village remembers when the mill last turned."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--types", nargs="+", default=list(TYPES), choices=TYPES)
    args = parser.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print("skipped: llama-cpp-python is not installed (it makes the files)")
        return
    with tempfile.TemporaryDirectory(prefix="gguf-types-") as folder:
        run(args, llama_cpp, Path(folder))


def run(args: argparse.Namespace, llama_cpp, folder: Path) -> None:
    """The benchmark, its files and their conversions in `folder`."""
    source = write_f32(gguf_path())
    files = {
        kind: _quantize(llama_cpp, source, folder / f"{kind}.gguf", kind) for kind in args.types
    }
    floats = LLM(dtype="float32", device="cpu")
    ours = {
        kind: LLM(str(path), device="cpu", offload_folder=str(folder))
        for kind, path in files.items()
    }
    theirs = {kind: _llama_cpp(path) for kind, path in files.items()}
    for llm in [floats, *ours.values()]:  # warm-up (and the compiled steps made)
        _ours_rate(llm, 1, 4)
    rates: dict[str, list[float]] = {"float32": []}
    rates.update({f"{kind} {who}": [] for kind in files for who in ("ours", "llama.cpp")})
    reads = []
    for _ in range(args.rounds):
        rates["float32"].append(_ours_rate(floats, 1, args.tokens))
        for kind in files:
            rates[f"{kind} ours"].append(_ours_rate(ours[kind], 1, args.tokens))
            rates[f"{kind} llama.cpp"].append(_llama_rate(theirs[kind], floats, args.tokens))
        reads.append(read_gb_per_s())
    read = statistics.median(reads)
    float_rate = statistics.median(rates["float32"])
    print(f"batch 1, {args.tokens} tokens, {args.rounds} rounds, threads "
          f"{torch.get_num_threads()}, read {read:.1f} GB/s; float32 {float_rate:.1f} tok/s")  # fmt: skip
    results = {}
    for kind, path in files.items():
        kept = sum(p.numel() * p.element_size() for p in ours[kind].model.parameters())
        rate, llama_rate = (statistics.median(rates[f"{kind} {w}"]) for w in ("ours", "llama.cpp"))
        ours_ppl = _perplexity(ours[kind])
        ours[kind].close()
        float_ppl = _perplexity(
            conversion := LLM(str(path), device="cpu", dtype="float32", offload_folder=str(folder))
        )
        conversion.close()
        llama_ppl = _llama_perplexity(theirs[kind])
        results[kind] = {
            "file_bytes": path.stat().st_size, "kept_bytes": kept,
            "tokens_per_s": rate, "round_tokens_per_s": rates[f"{kind} ours"],
            "bound_tokens_per_s": read * 1e9 / kept,
            "llama_cpp_tokens_per_s": llama_rate,
            "round_llama_cpp_tokens_per_s": rates[f"{kind} llama.cpp"],
            "perplexity": ours_ppl, "float32_perplexity": float_ppl,
            "llama_cpp_perplexity": llama_ppl,
        }  # fmt: skip
        print(
            f"{kind:>7}: file {path.stat().st_size / 2**20:6.1f} MiB, kept {kept / 2**20:6.1f} MiB;"
            f" {rate:6.1f} tok/s ({rate / float_rate:.2f}x float32, "
            f"{rate / llama_rate:.2f}x llama.cpp {llama_rate:.1f}, "
            f"{rate / results[kind]['bound_tokens_per_s']:.2f} of the read bound); perplexity "
            f"{ours_ppl:.3f} (float32 {float_ppl:.3f}, {ours_ppl / float_ppl - 1:+.2%}; "
            f"llama.cpp {llama_ppl:.3f})"
        )
    floats.close()
    payload = {"tokens": args.tokens, "rounds": args.rounds, "threads": torch.get_num_threads(),
               "read_gb_per_s": read, "round_read_gb_per_s": reads,
               "float32_tokens_per_s": float_rate, "round_float32_tokens_per_s": rates["float32"],
               "results": results}  # fmt: skip
    print(f"saved {common.save('gguf-types', torch.device('cpu'), payload)}")


def _quantize(llama_cpp, source: Path, target: Path, kind: str) -> Path:
    """`source` (F32 GGUF) quantized by llama.cpp to `kind` (its file type's name)."""
    settings = llama_cpp.llama_model_quantize_default_params()
    settings.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    settings.nthread = torch.get_num_threads()
    if llama_cpp.llama_model_quantize(
        str(source).encode(), str(target).encode(), ctypes.byref(settings)
    ):
        raise RuntimeError(f"llama.cpp could not quantize {source} to {kind}")
    return target


def _perplexity(llm: LLM) -> float:
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    output = llm.generate(TEXT, params, use_tqdm=False)[0]
    ids, entries = output.prompt_token_ids, output.prompt_logprobs
    logprobs = [entry[token].logprob for entry, token in zip(entries[1:], ids[1:], strict=True)]
    return math.exp(-sum(logprobs) / len(logprobs))


def _llama_perplexity(llama) -> float:
    """llama.cpp's perplexity of `TEXT` (its own tokens, which are ours: the same
    tokenizer), from the logits of every position."""
    import llama_cpp

    ids = llama.tokenize(TEXT.encode(), add_bos=False)
    llama.reset()
    vocab, logprobs = llama.n_vocab(), []
    for position, token in enumerate(ids[:-1]):
        llama.eval([token])
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(llama.ctx), shape=(vocab,))
        logits = logits.astype(np.float64) - logits.max()
        logprobs.append(logits[ids[position + 1]] - math.log(np.exp(logits).sum()))
    return math.exp(-sum(logprobs) / len(logprobs))


if __name__ == "__main__":
    main()
