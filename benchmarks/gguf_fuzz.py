"""Random header mutations of a small .gguf, each loaded by `LLM` in a fresh (forked) process.

A random Llama (2 layers, width 64, Q4_0 blocks, a byte-level tokenizer) is written with
`gguf.GGUFWriter`; each mutation changes one field of its header (a count, a length, a
value type, a setting's value, a tensor's dimension, type or offset), a few random bytes
of it, or cuts the file short. Each mutated file is loaded (as stored, or converted to
float32: every other mutation) and asked for two tokens in a child process with a time
limit and a cap on its resident memory, and the outcome is recorded:

- `load`: it loaded and generated (a mutation of something the model does not use);
- `offload_error`: an `offload.errors` error of one line (what a hostile file must get);
- `offload_error_lines`: an `offload.errors` error of more than one line;
- `traceback`: any other exception (a foreign traceback);
- `timeout`: past `--timeout-s`; `memory`: resident memory past `--max-rss-gb`;
- `crash`: the child died without a word (a signal).

    python benchmarks/gguf_fuzz.py [--count 200] [--seed 0] [--timeout-s 30]

Prints the counts and saves every case to benchmarks/results/gguf-fuzz-cpu-<stamp>.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q"}
_SCALAR[12] = "d"
_INTERESTING = (0, 1, 2, 3, 7, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 10**9, 2**62, 2**64 - 1)


def load(path: Path, dtype: str) -> dict:
    """Load `path` and ask for two tokens (in the forked child): its outcome."""
    import traceback

    from offload import LLM, SamplingParams
    from offload.errors import OffloadError

    try:
        llm = LLM(str(path), dtype=dtype)
        llm.generate("hi there", SamplingParams(max_tokens=2), use_tqdm=False)
        return {"outcome": "load"}
    except OffloadError as error:
        text = str(error)
        lines = "offload_error" if "\n" not in text else "offload_error_lines"
        return {"outcome": lines, "error": type(error).__name__, "message": text[:400]}
    except BaseException as error:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        return {
            "outcome": "traceback",
            "error": type(error).__name__,
            "message": str(error)[:300],
            "at": f"{frame.filename}:{frame.lineno}",
        }


def fields(data: bytes) -> list[tuple[str, int, str]]:
    """Every field of a GGUF v3 header: (what, offset, struct form), little-endian."""
    found = [("tensor count", 8, "Q"), ("settings count", 16, "Q")]
    num_tensors, num_settings = struct.unpack_from("<QQ", data, 8)
    at = 24

    def string(what: str) -> str:
        nonlocal at
        (length,) = struct.unpack_from("<Q", data, at)
        found.append((f"{what} length", at, "Q"))
        at += 8 + length
        return data[at - length : at].decode()

    def value(kind: int, what: str) -> None:
        nonlocal at
        if kind == 8:
            string(what)
        elif kind == 9:
            item, count = struct.unpack_from("<IQ", data, at)
            found.extend([(f"{what} item type", at, "I"), (f"{what} count", at + 4, "Q")])
            at += 12
            for _ in range(count):
                value(item, f"{what} item")
        else:
            found.append((f"{what} value", at, _SCALAR[kind]))
            at += struct.calcsize(_SCALAR[kind])

    for _ in range(num_settings):
        key = string("setting name")
        (kind,) = struct.unpack_from("<I", data, at)
        found.append((f"{key} type", at, "I"))
        at += 4
        value(kind, key)
    for _ in range(num_tensors):
        name = string("tensor name")
        (dims,) = struct.unpack_from("<I", data, at)
        found.append((f"{name} dimensions", at, "I"))
        for i in range(dims):
            found.append((f"{name} dim {i}", at + 4 + 8 * i, "Q"))
        at += 4 + 8 * dims
        found.extend([(f"{name} type", at, "I"), (f"{name} offset", at + 4, "Q")])
        at += 12
    # (the item values of long arrays are many: keep at most a few of each)
    counts: collections.Counter[str] = collections.Counter()
    kept = []
    for entry in found:
        counts[entry[0]] += 1
        if counts[entry[0]] <= 3:
            kept.append(entry)
    found[:] = kept
    found.append(("header end", at, ""))
    return found


# Settings a model's reader takes as sizes, ids or counts (added where the file lacks them).
_SETTINGS = (
    "llama.block_count", "llama.embedding_length", "llama.feed_forward_length",
    "llama.context_length", "llama.vocab_size", "llama.expert_count",
    "llama.expert_used_count", "llama.attention.head_count", "llama.attention.head_count_kv",
    "llama.attention.key_length", "llama.attention.value_length", "llama.rope.dimension_count",
    "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.padding_token_id", "tokenizer.ggml.unknown_token_id", "general.alignment",
)  # fmt: skip


def with_setting(data: bytes, key: str, value: object, kind, work: Path) -> bytes:
    """`data` written again by gguf's writer with the setting `key` set to `value` (of
    GGUF value type `kind`): every other setting and tensor as they were."""
    import gguf

    source = work / "setting-source.gguf"
    source.write_bytes(data)
    reader = gguf.GGUFReader(source)
    target = work / "setting-target.gguf"
    writer = gguf.GGUFWriter(target, "llama")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", key):
            continue
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_key_value(key, value, kind)
    for tensor in reader.tensors:
        writer.add_tensor(
            tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target.read_bytes()


def mutate(data: bytes, rng: random.Random, work: Path) -> tuple[bytes, str]:
    """One random mutation of the header of `data`, and what it was."""
    import gguf

    table = fields(data)
    end = table[-1][1]
    roll = rng.random()
    if roll < 0.25:
        key = rng.choice(_SETTINGS)
        value = rng.choice([0, 1, 3, 5, 256, 257, 2**20 + 1, 10**9, 2**31, 2**32 - 1])
        kind = rng.choice([gguf.GGUFValueType.UINT32, gguf.GGUFValueType.UINT64])
        return with_setting(data, key, value, kind, work), f"set {key} = {value} ({kind.name})"
    if roll < 0.35:
        cut = rng.randrange(4, len(data))
        return data[:cut], f"cut to {cut} bytes"
    if roll < 0.5:
        out = bytearray(data)
        spots = [rng.randrange(0, end) for _ in range(rng.randint(1, 4))]
        for spot in spots:
            out[spot] = rng.randrange(256)
        return bytes(out), f"random bytes at {spots}"
    what, at, form = rng.choice(table[:-1])
    old = struct.unpack_from("<" + form, data, at)[0]
    if form in ("f", "d"):
        new = rng.choice([float("nan"), float("inf"), -1.0, 0.0, 1e30, old * 2])
    elif form == "?":
        new = not old
    else:
        new = rng.choice([*_INTERESTING, old + 1, old - 1, old + 3, old - 3, old * 2])
        bits = 8 * struct.calcsize(form)
        new %= 2**bits
        if form.islower():  # (signed: as its two's complement)
            new = new - 2**bits if new >= 2 ** (bits - 1) else new
    out = bytearray(data)
    struct.pack_into("<" + form, out, at, new)
    return bytes(out), f"{what}: {old} -> {new}"


def run_child(path: Path, dtype: str, timeout_s: float, max_rss_bytes: int) -> dict:
    """Load `path` in a fresh process forked from this one (torch, transformers and offload
    imported once, here: a cold start took ~8 s a case), its resident memory polled and
    capped and its time limited; its outcome (see the module's docstring)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its outcome as one line of JSON down the pipe
        os.close(read_end)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        with os.fdopen(write_end, "w") as out:
            out.write(json.dumps(load(path, dtype)))
        os._exit(0)
    os.close(write_end)
    started, peak, status = time.monotonic(), 0, None
    while status is None:
        done, code = os.waitpid(pid, os.WNOHANG)
        if done:
            status = code
            break
        peak = max(peak, _rss_bytes(pid))
        elapsed = time.monotonic() - started
        if peak > max_rss_bytes or elapsed > timeout_s:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read_end)
            outcome = "memory" if peak > max_rss_bytes else "timeout"
            return {"outcome": outcome, "seconds": round(elapsed, 1), "peak_rss_mb": peak >> 20}
        time.sleep(0.05)
    seconds = round(time.monotonic() - started, 1)
    with os.fdopen(read_end) as pipe:
        said = pipe.read()
    result = json.loads(said) if said else {"outcome": "crash", "status": status}
    return {**result, "seconds": seconds, "peak_rss_mb": peak >> 20}


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--max-rss-gb", type=float, default=1.0)
    args = parser.parse_args()

    import torch

    # (imported once here, before the children fork: each would take seconds)
    import transformers.models.llama.modeling_llama  # noqa: F401
    from gguf_files import write_llama_gguf

    from offload import LLM  # noqa: F401
    from offload.bench.machine import save_json

    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="gguf-fuzz-"))
    original = write_llama_gguf(work / "original.gguf").read_bytes()
    os.environ["OFFLOAD_CACHE_DIR"] = str(work / "cache")
    cases = []
    for index in range(args.count):
        data, what = mutate(original, rng, work)
        path = work / f"case-{index}.gguf"
        path.write_bytes(data)
        dtype = "auto" if index % 2 == 0 else "float32"
        result = run_child(path, dtype, args.timeout_s, int(args.max_rss_gb * 2**30))
        cases.append({"index": index, "mutation": what, "dtype": dtype, **result})
        path.unlink()
        said = result.get("message", "").rsplit(".gguf", 1)[-1]  # (past the file's path)
        print(f"{index:4d} {result['outcome']:14s} {what[:50]:50s} {said[:110]}", flush=True)
    counts = collections.Counter(case["outcome"] for case in cases)
    print(json.dumps(dict(counts.most_common())))
    payload = {
        "seed": args.seed,
        "count": args.count,
        "timeout_s": args.timeout_s,
        "max_rss_gb": args.max_rss_gb,
        "counts": dict(counts),
        "cases": cases,
    }
    out = save_json(Path(__file__).parent / "results", "gguf-fuzz", torch.device("cpu"), payload)
    print(f"saved {out}")


if __name__ == "__main__":
    main()
