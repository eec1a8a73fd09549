"""Shared helpers for the benchmarks: timing with warm-up and medians, machine info, results."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from offload.offloader.units import last_level_cache_bytes

RESULTS = Path(__file__).parent / "results"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(
    fn: Callable[[], object], device: torch.device, warmup: int, repeats: int
) -> float:
    """Median wall time of `fn` after `warmup` untimed calls, synchronising the device
    before and after each timed call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def machine(device: torch.device) -> dict[str, object]:
    info: dict[str, object] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "cpu_model": _cpu_model(),
        # Decides the CPU's prefetch unit; two hosts of this VM differed 15x.
        "last_level_cache_bytes": last_level_cache_bytes(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def save(name: str, device: torch.device, payload: dict[str, object]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = RESULTS / f"{name}-{device.type}-{stamp}.json"
    path.write_text(json.dumps({"machine": machine(device), **payload}, indent=2) + "\n")
    return path


# --- Host memory, page cache and raw disk figures (Linux), for the disk-tier benchmark ---

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def process_memory_bytes() -> dict[str, int]:
    """This process's resident set now (`VmRSS`) and its peak (`VmHWM`), in bytes."""
    fields = {"VmRSS": "rss_bytes", "VmHWM": "peak_rss_bytes"}
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in fields:
            found[fields[key]] = int(value.split()[0]) * 1024  # the kernel reports kB
    return found


def reset_peak_rss() -> None:
    """Start `VmHWM` again from the current RSS (Linux's clear_refs value 5), after
    freeing what Python and glibc still hold, so that a peak belongs to what follows."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # returns freed heap pages to the kernel
    Path("/proc/self/clear_refs").write_text("5")


def meminfo_cached_bytes() -> int:
    """The machine's page cache (`Cached` in /proc/meminfo), in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Cached:"):
            return int(line.split()[1]) * 1024
    return 0


def drop_file_cache(paths: list[Path]) -> None:
    """Drop the files' pages from the page cache (written pages are flushed first: the
    kernel drops clean pages only)."""
    for path in paths:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


def warm_file_cache(paths: list[Path], chunk_bytes: int = 64 * 2**20) -> None:
    """Read the files once through the page cache, so later reads find them there."""
    for path in paths:
        with open(path, "rb", buffering=0) as file:
            while file.read(chunk_bytes):
                pass


def cached_file_bytes(paths: list[Path]) -> int:
    """Bytes of the files that are in the page cache now (`mincore` over a mapping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    int_ = ctypes.c_int
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, int_, int_, int_, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    total = 0
    for path in paths:
        size = path.stat().st_size
        if size == 0:
            continue
        descriptor = os.open(path, os.O_RDONLY)
        try:
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, descriptor, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
            try:
                pages = ctypes.create_string_buffer((size + _PAGE_BYTES - 1) // _PAGE_BYTES)
                if libc.mincore(address, size, pages) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
                total += sum(byte & 1 for byte in pages.raw) * _PAGE_BYTES
            finally:
                libc.munmap(address, size)
        finally:
            os.close(descriptor)
    return total


def direct_read_gb_per_s(
    paths: list[Path], chunk_bytes: int = 16 * 2**20, num_threads: int = 1
) -> float:
    """The disk's own sequential read bandwidth: the files read once, in order, with
    `O_DIRECT` (no page cache) in aligned chunks, their cached pages dropped first. With
    several threads each takes the next chunk in that order, so that many reads are in
    flight at once (as in a reader with that many I/O threads). GB/s (1e9 bytes)."""
    drop_file_cache(paths)
    return _sequential_read_gb_per_s(paths, chunk_bytes, os.O_DIRECT, num_threads)


def cached_read_gb_per_s(paths: list[Path], chunk_bytes: int = 16 * 2**20) -> float:
    """Read bandwidth from the page cache: the files read once to fill it, then read again
    in order, in chunks into one buffer on one thread. GB/s (1e9 bytes)."""
    warm_file_cache(paths)
    return _sequential_read_gb_per_s(paths, chunk_bytes, 0, 1)


def _sequential_read_gb_per_s(
    paths: list[Path], chunk_bytes: int, flags: int, num_threads: int
) -> float:
    import mmap
    import threading
    from concurrent.futures import ThreadPoolExecutor

    chunks = iter(
        [(path, offset) for path in paths for offset in range(0, path.stat().st_size, chunk_bytes)]
    )
    lock = threading.Lock()

    def read_chunks() -> int:
        buffer = mmap.mmap(-1, chunk_bytes)  # an anonymous mapping is page aligned (O_DIRECT)
        descriptors: dict[Path, int] = {}
        num_bytes = 0
        try:
            while True:
                with lock:
                    chunk = next(chunks, None)
                if chunk is None:
                    return num_bytes
                path, offset = chunk
                if path not in descriptors:
                    descriptors[path] = os.open(path, os.O_RDONLY | flags)
                # The last read of a file is short, which O_DIRECT allows.
                num_bytes += os.preadv(descriptors[path], [buffer], offset)
        finally:
            for descriptor in descriptors.values():
                os.close(descriptor)

    started = time.perf_counter()
    with ThreadPoolExecutor(num_threads) as pool:
        futures = [pool.submit(read_chunks) for _ in range(num_threads)]
        num_bytes = sum(future.result() for future in futures)
    return num_bytes / (time.perf_counter() - started) / 1e9


def write_random_checkpoint(
    folder: Path, config: dict[str, object], max_shard_bytes: int, seed: int = 0
) -> list[Path]:
    """A sharded safetensors checkpoint of random weights for the Hugging Face `config`
    (a config.json as a dict), written one shard at a time: tensors in the model's own
    order fill a shard up to `max_shard_bytes` (transformers' `max_shard_size` rule), so
    layers span files and at most one shard is ever in memory. Written into a staging
    folder renamed into place; an existing complete folder is reused. Returns the shards."""
    import shutil
    import tempfile

    from safetensors.torch import save_file

    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        return [folder / name for name in sorted(set(_weight_map(index_path).values()))]
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        specs = _parameter_specs(config)
        shards = _shard_by_size(specs, max_shard_bytes)
        generator = torch.Generator().manual_seed(seed)
        weight_map: dict[str, str] = {}
        for number, names in enumerate(shards, start=1):
            name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            tensors = {key: _random_tensor(key, *specs[key], generator) for key in names}
            save_file(tensors, staging / name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(names, name))
            del tensors
        total = sum(_numel(shape) * dtype.itemsize for shape, dtype in specs.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [folder / name for name in sorted(set(weight_map.values()))]


def _weight_map(index_path: Path) -> dict[str, str]:
    return json.loads(index_path.read_text())["weight_map"]


def _parameter_specs(config: dict[str, object]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every weight the checkpoint holds, in the model's order,
    from a model built on the meta device (nothing allocated)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**config)
    dtype = getattr(torch, str(config.get("dtype", "float32")))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}


def _shard_by_size(
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]], max_shard_bytes: int
) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for name, (shape, dtype) in specs.items():
        num_bytes = _numel(shape) * dtype.itemsize
        if shards[-1] and shard_bytes + num_bytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += num_bytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _random_tensor(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator
) -> torch.Tensor:
    """Norm weights 1, others N(0, 0.02) like Hugging Face's init: activations stay finite."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    return (torch.randn(shape, generator=generator) * 0.02).to(dtype)
