"""Products whose every output is one dot product in one fixed order, whatever the number
of rows beside it: a row's bits the same alone and in any batch (batch invariance, by
default, on a CPU).

BLAS kernels pick their method by the row count (MKL's float32 `F.linear` rounds a row
three ways, oneDNN's bf16 rounds a lone row apart: `engine/invariant.py`), and the compiled
step's one-row loop is yet another order. The kernels of `row_dot.c` compute each output
as 16-wide (AVX-512; 8-wide elsewhere) partial sums over the inputs in turn, then a fixed
tree over the lanes: for weights of float32, bfloat16 and float16 (widened in registers,
as stored), and the q8 block columns of `quant/layouts.py`. They read the weight once per
64 rows of x, 4 weight rows at a time across the OpenMP threads (torch's own runtime: the
same `libgomp.so.1`), so one row runs near the memory's rate and a few rows cost about what
one does; `row_attention.c`, in the same library, is a prompt's attention
(`engine/prompt_attention`), and `row_q4.c` the integer products of 4-bit weights
(`q4_linear`) and, where the CPU has AVX-512 VNNI, of q8 blocks of 32 (`q8_linear`: the
default model's head over 16 rows in half the float sums' time).

The library is compiled once per machine (`cc -O3 -march=native`, a few seconds) into the
offload cache, signed with the cache's key (`memory/cache_digest`), and loaded from a
memory file after its signature checks, so nothing another user wrote is run. Where no
compiler works the products are None and callers keep their kernels (then a batch may
round a row differently; `LLM(batch_invariant=True)` pads instead).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

import torch

from offload.memory import cache_digest
from offload.memory.cache_trust import cache_folder
from offload.offloader.ops import define_op

log = logging.getLogger(__name__)

MAX_ROWS = 64  # rows per call of the q8 kernel (its sums live on the stack); more: in pieces
FLOAT_TYPES = {
    torch.float32: "rowdot_f32",
    torch.bfloat16: "rowdot_bf16",
    torch.float16: "rowdot_f16",
}
# The weight dtypes a product takes these kernels for: every float (and what de-quantizes to
# float32). From memory they read bfloat16 and float16 at 0.8x float32's rate (widening
# costs), above oneDNN's kernels for them at any row count (docs/benchmarks.md).
USED_TYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
ENV = "OFFLOAD_ROW_DOT"  # "0": not used (the BLAS kernels, as before)
_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernels, built or loaded from the cache; None where they cannot be (logged)."""
    if os.environ.get(ENV, "1") == "0":
        return None
    try:
        data = _built()
        lib = _load(data)
    except Exception as error:  # (no compiler, a read-only cache: the BLAS kernels run)
        log.warning("the row-invariant products are not available (%s)", error)
        return None
    for name in FLOAT_TYPES.values():
        getattr(lib, name).argtypes = [_P, _I, _P, _I, _I, _I, _P, ctypes.c_int]
        getattr(lib, name).restype = ctypes.c_int  # (-1: no memory for x's pairs)
    lib.rowdot_bf16x.argtypes = lib.rowdot_bf16.argtypes
    lib.rowdot_bf16x.restype = ctypes.c_int
    lib.has_bf16_dot = bool(lib.rowdot_bf16_dot())  # (asked once, not at every product)
    lib.rowdot_q8.argtypes = [_P, _I, _P, _P, _P, ctypes.c_int, _I, _I, _I, _P, ctypes.c_int]
    lib.rowdot_q8.restype = ctypes.c_int  # (-1: no memory for x's block sums)
    lib.rowdot_attention.argtypes = [_P, *[_I] * 4, _P, _P, ctypes.c_int, *[_I] * 7]
    lib.rowdot_attention.argtypes += [_P, _P, _I, ctypes.c_float, _P, ctypes.c_int, _P]
    lib.rowdot_attention.restype = ctypes.c_int  # (-1: no memory for the scores)
    lib.rowdot_q4.argtypes = [_P, _I, _I, _P, _P, _P, ctypes.c_int, _I, _P, ctypes.c_int]
    lib.rowdot_q4.argtypes += [ctypes.c_int]
    lib.rowdot_q4.restype = ctypes.c_int  # (-1: no memory for x's integers)
    lib.rowdot_q8i.argtypes = lib.rowdot_q4.argtypes
    lib.rowdot_q8i.restype = ctypes.c_int  # (-1: no memory for x's integers)
    return lib


SOURCES = ("row_dot.c", "row_attention.c", "row_q4.c")  # (one unit: row_dot.c's helpers)


def _source() -> bytes:
    folder = resources.files("offload.quant")
    return b"\n".join(folder.joinpath(name).read_bytes() for name in SOURCES)


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler (cc) found")
    return compiler


def _built() -> bytes:
    """The library's bytes: from the cache where a signed copy for this source, compiler
    and CPU is there, else compiled now and kept."""
    compiler = _compiler()
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    key = hashlib.sha256(
        repr((_source(), version, _FLAGS, platform.machine(), cache_digest.cpu_identity())).encode()
    ).hexdigest()[:24]
    path = cache_folder("kernels") / f"row_dot-{key}.so"
    try:
        return cache_digest.read_signed(path)
    except FileNotFoundError:
        pass
    except cache_digest.NotSigned as why:
        log.warning("the kept kernels %s are not used (%s): compiling them", path, why)
    with tempfile.TemporaryDirectory(prefix="offload-row-dot-") as folder:
        source, out = Path(folder) / "row_dot.c", Path(folder) / "row_dot.so"
        source.write_bytes(_source())
        done = subprocess.run(
            [compiler, *_FLAGS, "-o", str(out), str(source)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-300:]}")
        data = out.read_bytes()
    cache_digest.write_signed(path, data)
    return data


def _load(data: bytes) -> ctypes.CDLL:
    """`data` loaded from a file only this process holds (a memory file where the system
    has them): the checked bytes are the ones run."""
    if hasattr(os, "memfd_create"):
        descriptor = os.memfd_create("offload-row-dot")
        os.write(descriptor, data)
        lib = ctypes.CDLL(f"/proc/self/fd/{descriptor}")
        os.close(descriptor)  # (the mapping keeps it)
        return lib
    with tempfile.TemporaryDirectory(prefix="offload-row-dot-") as folder:
        path = Path(folder) / "row_dot.so"
        path.write_bytes(data)
        return ctypes.CDLL(str(path))


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `row_linear(x, weight)` runs here: plain CPU tensors, a float weight of
    `USED_TYPES` whose rows are contiguous, a float x of the weight's width."""
    plain = (torch.Tensor, torch.nn.Parameter)
    if type(weight) not in plain or type(x) not in plain:
        return False  # (a tensor subclass: a quantized weight keeps its own kernel)
    if x.device.type != "cpu" or weight.device.type != "cpu" or weight.dim() != 2:
        return False
    if weight.dtype not in USED_TYPES or not x.is_floating_point() or not x.dim():
        return False
    if weight.stride(1) != 1 or x.shape[-1] != weight.shape[1]:
        return False
    return library() is not None


def bf16_dot() -> bool:
    """Whether this CPU's kernels multiply bfloat16 pairs (AVX512-BF16's vdpbf16ps): then
    bfloat16 rows times bfloat16 weights take `rowdot_bf16x`, the same bits as widening
    them (subnormals aside) at twice the products a cycle."""
    lib = library()
    return lib is not None and lib.has_bf16_dot


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """`F.linear(x, weight, bias)` with each output one fixed-order dot product (float32
    sums, then x's dtype); callers check `fits` first. Whether the pairs' instruction is
    used depends on the dtypes only, so never on the rows beside a row."""
    pairs = x.dtype is torch.bfloat16 and weight.dtype is torch.bfloat16 and bf16_dot()
    rows = x.reshape(-1, x.shape[-1]).contiguous() if pairs else _rows(x)
    out = torch.empty(rows.shape[0], weight.shape[0])
    if rows.shape[0]:
        function = getattr(library(), "rowdot_bf16x" if pairs else FLOAT_TYPES[weight.dtype])
        failed = function(
            rows.data_ptr(),
            rows.shape[0],
            weight.data_ptr(),
            weight.shape[0],
            weight.shape[1],
            weight.stride(0),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError(f"no memory for a product's {rows.shape[0]} input rows")
    out = out.view(*x.shape[:-1], weight.shape[0]).to(x.dtype)
    return out if bias is None else out + bias


def step_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """`F.linear(x, weight, bias)` inside a compiled decode step's opaque products (the GGUF
    kinds and packed forms that de-quantize for it): `row_linear` where it fits and x
    holds 1 to `MAX_ROWS` rows, as the eager step's products are (`cpu_linear`), so a
    row's bits do not depend on its batch there either; else `F.linear`."""
    if 1 <= x.numel() // max(x.shape[-1], 1) <= MAX_ROWS and fits(x, weight):
        return row_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as float32 rows [n, width], contiguous (a copy only where it is not so)."""
    return x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()


def q8_fits(x: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether `q8_linear` runs here: CPU tensors, blocks of a multiple of the kernel's
    lanes (8 or 16), 256 values at most."""
    cpu = x.device.type == "cpu" and values.device.type == "cpu"
    if not cpu or library() is None:
        return False
    return values.shape[-1] % library().rowdot_lanes() == 0 and values.shape[-1] <= 256


def q8_linear(
    x: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    plain: bool = False,
) -> torch.Tensor:
    """x [rows, in] times a q8 weight (`values` int8 [blocks, out, g], `scales` and
    `offsets` [blocks, out]), in x's dtype; callers check `q8_fits` first. Blocks of 32
    where the CPU has AVX-512 VNNI: the integer sums of `row_q4.c` (`rowdot_q8i`; `plain`:
    its one-output-at-a-time sums, the same bits), else float32 sums (`rowdot_q8`)."""
    blocks, outs, group = values.shape
    rows = _rows(x)
    half = scales.dtype == torch.float16
    scales = scales.to(torch.float16 if half else torch.float32).contiguous()
    if offsets is not None:
        offsets = offsets.to(scales.dtype).contiguous()
    values = values.contiguous()
    out = torch.empty(rows.shape[0], outs)
    if group == 32 and q4_fast():  # (16 rows of the default model's head: 4x faster)
        args = (rows.data_ptr(), rows.shape[0], rows.shape[1], values.data_ptr())
        args += (scales.data_ptr(), None if offsets is None else offsets.data_ptr(), half, outs)
        failed = library().rowdot_q8i(*args, out.data_ptr(), torch.get_num_threads(), plain)
        if failed:
            raise MemoryError(f"no memory for a product's {rows.shape[0]} input rows")
        return out.to(x.dtype)
    for start in range(0, rows.shape[0], MAX_ROWS):  # (rows apart: the same bits in pieces)
        part = rows[start : start + MAX_ROWS]
        failed = library().rowdot_q8(
            part.data_ptr(),
            part.shape[0],
            values.data_ptr(),
            scales.data_ptr(),
            None if offsets is None else offsets.data_ptr(),
            int(half),
            outs,
            blocks,
            group,
            out[start:].data_ptr(),
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError(f"no memory for a product's {part.shape[0]} input rows' sums")
    return out.to(x.dtype)


def q4_fast() -> bool:
    """Whether the 4-bit products (`row_q4.c`) run vectorised here (AVX-512 VNNI): else a
    4-bit weight keeps torch's int4 kernel (`layouts.layout_for`)."""
    return library() is not None and bool(library().rowdot_q4_vnni())


def q4_linear(
    x: torch.Tensor,
    nibbles: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    plain: bool = False,
) -> torch.Tensor:
    """x [rows, in] times a q4 weight (`layouts.q4_tensors`: `nibbles` uint8 [out / 16,
    in / 32, 256], `scales` and `offsets` [in / 32, out]), in x's dtype; `plain`: the
    kernel's one-output-at-a-time sums, the same bits (for the tests). (Called ~200 times
    a decode step: nothing is converted or copied where nothing needs to be.)"""
    plain_rows = x.dtype is torch.float32 and x.dim() == 2 and x.is_contiguous()
    rows = x if plain_rows else _rows(x)
    groups, outs = scales.shape
    fits = offsets.dtype is scales.dtype and rows.shape[1] == groups * 32
    if not fits or nibbles.shape != ((outs + 15) // 16, groups, 256):
        raise ValueError(f"a q4 weight {tuple(nibbles.shape)} does not take {tuple(x.shape)}")
    if not (nibbles.is_contiguous() and scales.is_contiguous() and offsets.is_contiguous()):
        nibbles, scales, offsets = (t.contiguous() for t in (nibbles, scales, offsets))
    out = torch.empty(rows.shape[0], outs)
    args = (rows.data_ptr(), rows.shape[0], rows.shape[1], nibbles.data_ptr())
    args += (scales.data_ptr(), offsets.data_ptr(), scales.dtype is torch.float16, outs)
    failed = library().rowdot_q4(*args, out.data_ptr(), torch.get_num_threads(), plain)
    if failed:
        raise MemoryError(f"no memory for a product's {rows.shape[0]} input rows")
    return out if x.dtype is torch.float32 else out.to(x.dtype)


def _row_linear_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# One opaque op in a compiled step (its weight's address is known only when it runs).
ROW_LINEAR = define_op(
    "row_linear", "(Tensor x, Tensor weight) -> Tensor", row_linear, _row_linear_fake
)
