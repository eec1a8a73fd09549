"""A .gguf read by transformers' own GGUF reader: de-quantized to float32 and saved as a
plain safetensors checkpoint (the default model's conversion, and any .gguf's where a
dtype is asked for), with the one-line errors for what transformers cannot read, and a
patch of gguf's parser that makes each of its tables once while a .gguf is read."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

from offload.errors import ModelError, OffloadError
from offload.model.tokenizer import save_tokenizer


def save_as_float(source: Path, out_dir: Path) -> None:
    """De-quantize the GGUF with transformers' reader and save it as plain safetensors.
    A damaged file, a full disk or a file-size limit is a ValueError that says which."""
    import struct

    from safetensors import SafetensorError

    from offload.model.gguf_checks import check_finite, check_gguf_header

    check_finite(source, check_gguf_header(source).tensors)
    try:
        _dequantize_and_save(source, out_dir)
    except struct.error as error:  # a field that runs past the end of the file
        raise ValueError(f"{source} is damaged or truncated ({error})") from None
    except (SafetensorError, OSError) as error:
        raise ValueError(conversion_failure(error)) from None


def conversion_failure(error: BaseException) -> str:
    """One line for a conversion that failed; a full disk or a file-size limit is named
    as such (safetensors reports them as its own error)."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    text = text if len(text) <= 400 else text[:397] + "..."  # (one line, whoever raised it)
    full = "No space left" in text or "File too large" in text
    if full or getattr(error, "errno", None) in (errno.ENOSPC, errno.EFBIG):
        return f"the disk is full or the file-size limit was reached ({text})"
    return text


def _dequantize_and_save(source: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The GGUF holds tensors and settings only: no code of its package ever runs.
    with gguf_parsed_once():
        with read_by_transformers(source, "tokenizer"):
            tokenizer = AutoTokenizer.from_pretrained(
                source.parent, gguf_file=source.name, trust_remote_code=False
            )
        with read_by_transformers(source, "model"):
            model = AutoModelForCausalLM.from_pretrained(
                source.parent, gguf_file=source.name, dtype=torch.float32, trust_remote_code=False
            )
    # The de-quantized weights are ordinary float tensors: drop the GGUF marker so the
    # model saves (and later loads) as a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    save_tokenizer(tokenizer, out_dir)
    align_safetensors(out_dir / "model.safetensors")


_ALIGNMENT = 64  # bytes (the CPU allocator's; cpu_linear.ALIGNMENT)


def data_start(path: Path) -> int | None:
    """Where a safetensors file's tensor bytes begin: after its 8-byte length and header;
    None where the file cannot hold that (not a safetensors file: left as it is, its load
    says what is wrong)."""
    with open(path, "rb") as file:
        head = file.read(8)
        size = os.fstat(file.fileno()).st_size
    start = 8 + int.from_bytes(head, "little")
    return start if len(head) == 8 and start <= size else None


def _aligned(path: Path) -> bool:
    start = data_start(path)
    return start is None or start % _ALIGNMENT == 0


def align_safetensors(path: Path) -> None:
    """Rewrite the safetensors file at `path` so that its tensor bytes begin at a 64-byte
    boundary: its header padded with spaces (as the format allows). A tensor of the disk
    tier is read or mapped at its file offset modulo 64, and a batch's products over a
    weight off that boundary pay a copy (`cpu_linear.weight_times`); every tensor of the
    default model is a multiple of 64 bytes long, so all of them start aligned then."""
    if _aligned(path):
        return
    start = data_start(path)
    aligning = path.with_name(f".{path.name}.aligning")
    try:
        with open(path, "rb") as source, open(aligning, "wb") as out:
            source.seek(8)
            header = source.read(start - 8).rstrip(b" ")
            padded = header + b" " * (-(8 + len(header)) % _ALIGNMENT)
            out.write(len(padded).to_bytes(8, "little") + padded)
            shutil.copyfileobj(source, out, 16 * 2**20)
            out.flush()
            os.fsync(out.fileno())
        os.replace(aligning, path)
    except BaseException:  # a full disk, Ctrl-C: the file stays as it was, and no half copy
        aligning.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def read_by_transformers(source: Path, what: str) -> Iterator[None]:
    """transformers reading the .gguf `source`'s `what` (its settings, tokenizer, model):
    an error it raises for what the file holds (a merge that is not two tokens, a list
    where a number belongs: a TypeError, the tokenizers library's bare Exception) is a
    one-line ModelError naming the file. A full disk (OSError) is left to the caller."""
    try:
        yield
    except (OffloadError, OSError):
        raise
    except Exception as error:
        text = " ".join(str(error).split()) or type(error).__name__
        text = text if len(text) <= 300 else text[:297] + "..."
        raise ModelError(
            f"{source}: transformers cannot read its {what} ({type(error).__name__}: {text})"
        ) from None


_GGUF_PATCH = threading.Lock()


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """transformers parses the file anew for the config, the tokenizer and the weights,
    and rebuilds gguf's tensor-name table once per tensor: inside this block each is made
    once and reused (the same objects, read only, so the same result at half the time),
    and the file is parsed by `gguf_fast.FastReader` (the same fields, 16x sooner).
    transformers imports both names from `gguf` at each call, which is what is swapped."""
    import gguf

    from offload.model.gguf_fast import FastReader

    with _GGUF_PATCH:
        reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
        gguf.GGUFReader = functools.lru_cache(maxsize=2)(FastReader)
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=8)(names)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader, names
