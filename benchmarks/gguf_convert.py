"""A .gguf read as stored, at a size where memory and reads show (issue 47): its first run's
conversion (peak RSS, cache growth, time) and its disk tier's read rate.

    python benchmarks/gguf_convert.py [--dir /tmp/offload-gguf-bench] [--hidden 2048]
        [--layers 12] [--kernels cpu] [--tokens 6] [--part convert|read|all]

The .gguf is a random Llama in Q4_0 blocks (random block bytes, small float16 scales: no
quantizer runs) with the default model's tokenizer, written once into `--dir` with
`gguf.GGUFWriter` and reused. `convert`: a fresh conversion in a child process (peak RSS
over the RSS before it, as /proc's VmHWM counts it: mapped pages of the .gguf included),
the bytes it adds to the cache folder, and the seconds. `read`: the converted model with
every decoder layer on disk (`cpu_memory_gb=0`, `disk_io="direct"`, the page cache dropped
first), `--tokens` greedy tokens from token ids: the tier's read rate (bytes over the wall
time with a read in flight), the reads a layer takes, and beside them the same files read
alone in the tier's layer order and sequentially by the tier's reader (O_DIRECT), as `dd`
would. Timings are noisy on a shared machine: run it alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import common

HEADS, KV_HEADS = 16, 4


def write_gguf(path: Path, hidden: int, layers: int, order: str = "layer") -> Path:
    """A random Llama of `layers` layers of width `hidden` in Q4_0 blocks, tied head; its
    tensors by layer ("layer": as llama.cpp writes them) or by kind ("kind": every layer's
    query, then every layer's key, ...: a layer's tensors spread over the file)."""
    import gguf

    from offload.model.default import gguf_path

    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    source = gguf.GGUFReader(gguf_path())
    writer = gguf.GGUFWriter(path.with_suffix(".part"), "llama")
    for key, field in source.fields.items():
        if key.startswith(("GGUF.", "general.architecture", "llama.")):
            continue
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    inner = hidden * 11 // 4 // 256 * 256
    for add, value in (
        (writer.add_context_length, 2048), (writer.add_embedding_length, hidden),
        (writer.add_block_count, layers), (writer.add_feed_forward_length, inner),
        (writer.add_head_count, HEADS), (writer.add_head_count_kv, KV_HEADS),
        (writer.add_rope_freq_base, 10000.0), (writer.add_layer_norm_rms_eps, 1e-5),
    ):  # fmt: skip
        add(value)
    rng = np.random.default_rng(0)
    kv = hidden // HEADS * KV_HEADS
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    shapes = {"token_embd.weight": (vocab, hidden)}
    for i in range(layers):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.attn_q.weight": (hidden, hidden),
            f"blk.{i}.attn_k.weight": (kv, hidden), f"blk.{i}.attn_v.weight": (kv, hidden),
            f"blk.{i}.attn_output.weight": (hidden, hidden),
            f"blk.{i}.ffn_norm.weight": (hidden,), f"blk.{i}.ffn_gate.weight": (inner, hidden),
            f"blk.{i}.ffn_up.weight": (inner, hidden), f"blk.{i}.ffn_down.weight": (hidden, inner),
        })  # fmt: skip
    shapes["output_norm.weight"] = (hidden,)
    if order == "kind":
        shapes = dict(sorted(shapes.items(), key=lambda item: item[0].split(".")[-2:]))
    for name, shape in shapes.items():
        if len(shape) == 1:
            writer.add_tensor(name, np.ones(shape, np.float32))
            continue
        blocks = rng.integers(0, 256, (shape[0], shape[1] // 32, 18), dtype=np.uint8)
        scales = (rng.random((shape[0], shape[1] // 32)) * 0.02 + 0.001).astype(np.float16)
        blocks[..., :2] = scales[..., None].view(np.uint8)
        data = blocks.reshape(shape[0], -1)
        writer.add_tensor(
            name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_0
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.with_suffix(".part").rename(path)
    return path


CONVERT = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    import torch, transformers  # (imported before the baseline: not the conversion's)
    from offload.model.sources import resolve_model
    from offload.probes.layout_choice import LayoutChooser

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    before = status("VmRSS")
    started = time.perf_counter()
    folder = resolve_model(
        sys.argv[1], sys.argv[2], quantization="gguf", kernels=sys.argv[3],
        layout_chooser=LayoutChooser,
    )
    print(json.dumps({"folder": str(folder), "seconds": time.perf_counter() - started,
                      "peak_growth_bytes": status("VmHWM") - before}))
    """
)

READ = textwrap.dedent(
    """
    import json, sys
    from offload import LLM, SamplingParams
    from offload.probes.disk import disk_gb_per_s, layer_reads

    folder, tokens, eager = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "eager"
    llm = LLM(folder, device="cpu", cpu_memory_gb=0, disk_io="direct", max_model_len=64,
              enforce_eager=eager)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate({"prompt_token_ids": [1, 5, 9]}, params, use_tqdm=False)  # (warm-up)
    before = llm.transfer_stats()
    llm.generate({"prompt_token_ids": [1, 5, 9]}, params, use_tqdm=False)
    run = llm.transfer_stats() - before
    units = [u for u in llm.offloader._layers if getattr(u, "disk", None) is not None]
    extents = [len(u.disk.extents) for u in units]
    llm.close()
    reads = layer_reads(__import__("pathlib").Path(folder), "model.layers")
    total = sum(e.num_bytes for layer in reads for e in layer)
    files = sorted({e.path for layer in reads for e in layer})
    from offload.memory.disk_reader import DiskReader
    split = hasattr(DiskReader, "_request_bytes")  # (this version splits a layer's read)
    print(json.dumps({
        "requests": "a layer over the threads, at least 4 MiB" if split else "4 MiB",
        "tier_read_gb_per_s": run.disk_read_gb_per_s,
        "read_bytes_per_forward": run.disk_read_bytes / max(run.num_forwards, 1),
        "extents_per_layer": sorted(set(extents)),
        "layer_order_alone_gb_per_s": disk_gb_per_s(files, total, 2, reads=reads),
        "sequential_gb_per_s": disk_gb_per_s(files, total, 2),
    }))
    """
)


def compare_reads(
    folders: list[Path], rounds: int, chunks_mib: Sequence[int] = (4, 16)
) -> dict[str, object]:
    """The disk tier's reads of each folder's layers, in the order they run (two threads,
    its request size and 16 MiB; alone and beside matrix products on the compute
    threads), folders interleaved round by round, so that a shared machine's drift falls
    on each alike: median GB/s, and the reads a layer takes."""
    import statistics

    from offload.probes.disk import disk_gb_per_s, layer_reads

    cases = [
        (f, chunk, computing)
        for f in folders
        for chunk in chunks_mib
        for computing in (False, True)
    ]
    rates: dict[str, list[float]] = {}
    extents = {}
    for _ in range(rounds):
        for folder, chunk, computing in cases:
            reads = layer_reads(folder, "model.layers")
            extents[folder.name] = sorted({len(layer) for layer in reads})
            total = sum(e.num_bytes for layer in reads for e in layer)
            files = sorted({e.path for layer in reads for e in layer})
            rate = disk_gb_per_s(
                files, total, 2, computing=computing, reads=reads, chunk_bytes=chunk * 2**20
            )
            rates.setdefault(
                f"{folder.name} {chunk} MiB{' computing' if computing else ''}", []
            ).append(rate)
    from offload.memory.disk_reader import DiskReader

    split = hasattr(DiskReader, "_request_bytes")  # (this version splits a layer's read)
    return {
        "requests": "a layer over the threads, at least the size" if split else "the size",
        "extents_per_layer": extents,
        "median_gb_per_s": {key: round(statistics.median(v), 3) for key, v in rates.items()},
        "all_gb_per_s": {key: [round(r, 3) for r in v] for key, v in rates.items()},
    }


def _child(script: str, *args: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, check=False
    )
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/offload-gguf-bench"))
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--kernels", default="cpu", choices=("cpu", "gguf"))
    parser.add_argument("--tokens", type=int, default=6)
    parser.add_argument("--step", default="eager", choices=("eager", "compiled"))
    parser.add_argument("--part", default="all", choices=("convert", "read", "all"))
    parser.add_argument("--order", default="layer", choices=("layer", "kind"))
    parser.add_argument("--tag", default="", help="names the cache folder (another version's)")
    parser.add_argument("--compare", type=Path, nargs="+", help="converted folders: their reads")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunks-mib", type=int, nargs="+", default=[4, 16])
    args = parser.parse_args()
    if args.compare:
        result = compare_reads(args.compare, args.rounds, args.chunks_mib)
        print(json.dumps(result, indent=1))
        print("saved", common.save("gguf_reads", __import__("torch").device("cpu"), result))
        return
    name = f"llama-{args.hidden}x{args.layers}-{args.order}.gguf"
    source = write_gguf(args.dir / name, args.hidden, args.layers, args.order)
    cache = args.dir / f"cache-{args.kernels}-{args.order}{args.tag}"
    result: dict[str, object] = {
        "gguf_bytes": source.stat().st_size, "kernels": args.kernels, "order": args.order,
        "tag": args.tag,
    }  # fmt: skip
    if args.part in ("convert", "all"):
        subprocess.run(["rm", "-rf", str(cache)], check=True)
        converted = _child(CONVERT, str(source), str(cache), args.kernels)
        grown = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
        result.update(converted, cache_growth_bytes=grown)
    if args.part in ("read", "all"):  # (a folder there already: as its version made it)
        made = [p for p in cache.glob("*") if p.is_dir() and not p.name.startswith(".")]
        folder = (
            str(made[0])
            if made
            else _child(CONVERT, str(source), str(cache), args.kernels)["folder"]
        )
        result.update(_child(READ, folder, str(args.tokens), args.step), step=args.step)
    for key, value in result.items():
        print(f"{key:>28}: {value}")
    print("saved", common.save("gguf_convert", __import__("torch").device("cpu"), result))


if __name__ == "__main__":
    main()
