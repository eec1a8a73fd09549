"""Host memory for offloaded tensors: exact-size slabs, pinning, zero-copy device views.

This file and `copy_engine.py` are the only places that touch CUDA-specific memory
APIs; everything above them runs unchanged with the CPU as the compute device.
"""

from __future__ import annotations

import _thread
import ctypes
import functools
import gc
import mmap
import os
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

ALIGN_BYTES = 256  # offsets inside a slab: enough for any dtype and for vector loads
_DISABLE_PIN_ENV = "VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY"
_DISABLE_UVA_ENV = "VLLM_WEIGHT_OFFLOADING_DISABLE_UVA"
_CUDA_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def should_pin_memory(device: torch.device, disabled: bool = False) -> bool:
    """Pin host memory only when a CUDA device will read it and nobody disabled it
    (config field or vLLM's `VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY`)."""
    return (
        device.type == "cuda"
        and torch.cuda.is_available()
        and not disabled
        and not _env_flag(_DISABLE_PIN_ENV)
    )


def zero_copy_available(device: torch.device, pinned: bool, disabled: bool = False) -> bool:
    """Whether compute on `device` can read a host slab in place: the CPU always can, a
    CUDA device through a UVA view of pinned (registered) memory. Either way it can be
    turned off (config field or vLLM's `VLLM_WEIGHT_OFFLOADING_DISABLE_UVA`)."""
    if disabled or _env_flag(_DISABLE_UVA_ENV):
        return False
    return device.type == "cpu" or (device.type == "cuda" and pinned)


@dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype and (optionally) strides of a tensor to place in a slab. Strides
    are kept so a non-contiguous parameter keeps its layout, and kernels see the same
    memory order as before offloading."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...] | None = None  # None: contiguous

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        stride = None if tensor.is_contiguous() else tuple(tensor.stride())
        return cls(tuple(tensor.shape), tensor.dtype, stride)

    @property
    def num_elements(self) -> int:
        """Elements spanned in memory (the numel for a dense tensor)."""
        if any(size == 0 for size in self.shape):
            return 0
        if self.stride is None:
            return _numel(self.shape)
        return 1 + sum(
            (size - 1) * step for size, step in zip(self.shape, self.stride, strict=True)
        )

    @property
    def num_bytes(self) -> int:
        return self.num_elements * self.dtype.itemsize

    def view_of(self, raw: torch.Tensor) -> torch.Tensor:
        """This tensor over `raw`, a uint8 tensor of `num_bytes` bytes."""
        flat = raw.view(self.dtype)
        if self.stride is None:
            return flat.view(self.shape)
        return flat.as_strided(self.shape, self.stride)


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def meminfo_bytes(field: str) -> int | None:
    """A field of /proc/meminfo ("MemTotal", "MemAvailable") in bytes; None where the
    kernel does not provide it."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_ram_bytes() -> int:
    """Host memory that can be had now without swapping (the kernel's MemAvailable)."""
    available = meminfo_bytes("MemAvailable")
    if available is not None:
        return available
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def trim_freed_memory() -> bool:
    """Hand the pages glibc's malloc holds free back to the OS (`malloc_trim(0)`); False
    where there is no glibc. A dropped model leaves megabytes of freed tensors scattered
    through malloc's heaps, which it keeps: a process that loads models again and again
    grew load after load without this, and hardly with it (docs/benchmarks.md, "Leaks: an
    `LLM` made, used and dropped 20 times (2026-11-26)")."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def give_back(tensor: torch.Tensor) -> None:
    """`tensor` (on the CPU, contiguous, its memory its own) zeroed, its whole pages handed
    back to the OS (`madvise(MADV_DONTNEED)`: they read as zeros and take memory again only
    when written); the bytes at its ends that share a page with others written as zeros.
    Where the call is not there, all of it written as zeros."""
    advise, dont_need = _madvise(), getattr(mmap, "MADV_DONTNEED", None)
    flat = tensor.view(-1).view(torch.uint8)
    start, size, page = tensor.data_ptr(), flat.numel(), mmap.PAGESIZE
    first = -(-start // page) * page
    last = (start + size) // page * page
    if advise is None or dont_need is None or last <= first:
        flat.zero_()
        return
    if advise(first, last - first, dont_need) != 0:
        flat.zero_()
        return
    flat[: first - start].zero_()
    flat[last - start :].zero_()


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        advise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    advise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advise.restype = ctypes.c_int
    return advise


_trim_pending = threading.Event()


def trim_after_collection() -> None:
    """Trim malloc's heaps at the end of the next garbage collection. For an object's
    `weakref.finalize`: its callback runs before the object's own tensors are freed, and a
    dropped model's cycles go at the next collection, so trimming there gets them."""
    _trim_pending.set()
    if _trim_on_collection not in gc.callbacks:
        gc.callbacks.append(_trim_on_collection)


def _trim_on_collection(phase: str, info: dict) -> None:
    # CPython drops a KeyboardInterrupt that leaves a gc callback ("Exception ignored in"):
    # a Ctrl-C during the trim is caught here and sent again from a helper thread once
    # this callback has returned.
    try:
        if phase == "stop" and _trim_pending.is_set():
            _trim_pending.clear()
            trim_freed_memory()
    except KeyboardInterrupt:
        returning = _thread.allocate_lock()
        returning.acquire()
        _thread.start_new_thread(_interrupt_main_after, (returning,))
        returning.release()  # the last call: only the return follows


def _interrupt_main_after(returning: _thread.LockType) -> None:
    """SIGINT to the main thread once the gc callback has let go of `returning` (this
    thread then waits for the GIL, which the callback holds until it has returned). Not
    from inside the callback: raised there, even by `signal.raise_signal`, it is dropped
    again. A signal, as Ctrl-C's, not `_thread.interrupt_main()`: it also ends a sleep."""
    with returning:
        pass
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def pack_offsets(sizes: Sequence[int], align: int = ALIGN_BYTES) -> tuple[list[int], int]:
    """Byte offsets of `sizes` packed one after another at multiples of `align`, and
    the total size (the end of the last tensor: no padding after it)."""
    offsets: list[int] = []
    end = 0
    for size in sizes:
        start = -(-end // align) * align
        offsets.append(start)
        end = start + size
    return offsets, end


class _HostBlock(mmap.mmap):
    """Anonymous, page-aligned host memory of an exact size.

    Tensors made with `torch.frombuffer` keep this object alive, so it is released
    (unregistered, then unmapped) only when the last tensor viewing it is gone.
    """

    registered_device: int | None = None

    def register(self, device: torch.device) -> None:
        address = torch.frombuffer(self, dtype=torch.uint8).data_ptr()
        with torch.cuda.device(device):
            result = torch.cuda.cudart().cudaHostRegister(
                address, len(self), _CUDA_HOST_REGISTER_PORTABLE_MAPPED
            )
        torch.cuda.check_error(result)
        self.registered_device = device.index if device.index is not None else 0
        self._address = address

    def __del__(self) -> None:
        if self.registered_device is not None:
            torch.cuda.cudart().cudaHostUnregister(self._address)
            self.registered_device = None


class HostSlab:
    """One exact-size host buffer holding several tensors at aligned offsets.

    With `pin=True` the buffer is page-locked with `cudaHostRegister` (exactly its
    size, unlike the caching host allocator's power-of-two blocks), so copies from it
    run at full link speed and the GPU can read it in place.
    """

    def __init__(self, specs: Sequence[TensorSpec], *, pin_for: torch.device | None = None):
        offsets, total = pack_offsets([spec.num_bytes for spec in specs])
        self.num_bytes = total
        self.payload_bytes = sum(spec.num_bytes for spec in specs)
        self._block = _HostBlock(-1, max(total, 1))
        if pin_for is not None and total > 0:
            self._block.register(pin_for)
        self.is_pinned = self._block.registered_device is not None
        buffer = torch.frombuffer(self._block, dtype=torch.uint8)[:total]  # [num_bytes]
        self.buffer = buffer
        self.offsets = offsets
        self.views = [
            spec.view_of(buffer[start : start + spec.num_bytes])
            for start, spec in zip(offsets, specs, strict=True)
        ]

    @property
    def mapped_bytes(self) -> int:
        """Host bytes actually reserved (the slab rounded up to whole pages)."""
        return -(-len(self._block) // mmap.PAGESIZE) * mmap.PAGESIZE


class _CudaArrayInterface:
    """Lets `torch.as_tensor` wrap a pinned host address as a CUDA tensor (no copy)."""

    def __init__(self, host: torch.Tensor):
        self._host = host  # keeps the host memory alive as long as the device view
        self.__cuda_array_interface__ = {
            "shape": (host.numel(),),
            "typestr": "|u1",
            # With unified virtual addressing, memory registered as mapped has the same
            # address on the device as on the host (cudaDevAttrCanUseHostPointerForRegisteredMem).
            "data": (host.data_ptr(), False),
            "strides": None,
            "version": 3,
        }


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on `device` whose storage is `host`'s pinned memory: kernels read it over
    the link at each use, and no device memory is allocated."""
    spec = TensorSpec.of(host)
    flat = host.as_strided((spec.num_elements,), (1,)).view(torch.uint8)
    with torch.cuda.device(device):
        raw = torch.as_tensor(_CudaArrayInterface(flat), device=device)
    if raw.data_ptr() != flat.data_ptr():
        raise RuntimeError("zero-copy device view failed: the driver returned another address")
    return spec.view_of(raw)
