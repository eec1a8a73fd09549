"""What `model=` may name, resolved to a folder of safetensors that the loader reads.

- None: the default model (SmolLM2-135M-Instruct, see `default.py`); callers keep it, and
  any .gguf, as stored on a CPU or GPU unless a dtype is asked for (`stored_unless_asked`);
- a folder with safetensors weights: itself;
- a folder with only `pytorch_model*.bin` weights, or a `.gguf` file: converted once into
  safetensors in the offload cache (or `offload_folder`), keyed by the source files'
  names, sizes and mtimes (a changed source converts again, a stale or foreign folder is
  never reused), then loaded the fast way, and streamed from there by a disk tier;
- a Hugging Face id (`org/name`): its snapshot in the local Hugging Face cache, as
  transformers finds it (`HF_HUB_OFFLINE=1` keeps it to the cache; online, a missing one
  is downloaded with the hub's progress bars).

A conversion writes into a staging folder renamed into place when complete, under an
exclusive `flock`, so a killed conversion leaves no half model (its staging folder is
removed by the next conversion of the same source) and two processes convert once. The
folder conversions go into must be the user's own, and a conversion is used only when its
signature checks (`memory.cache_trust`, `memory.cache_digest`): else it is converted again.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import glob
import hashlib
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError

from offload.config.parts import DiskOffloadConfig
from offload.errors import ModelError
from offload.memory.cache_digest import sign_entry
from offload.memory.cache_trust import cache_folder, cache_key, trusted_folder
from offload.memory.host import available_ram_bytes
from offload.memory.placement import AUTO, DiskIO
from offload.memory.safetensors import StoredTensor, checkpoint_tensors
from offload.model.aligned_copy import misaligned_matrices, write_aligned
from offload.model.bin_checkpoints import from_bin as _from_bin
from offload.model.cache_folder import cache_dir, entry_not_usable
from offload.model.default import default_model_path, gguf_path
from offload.model.gguf_float import conversion_failure
from offload.offloader.disk_placement import AUTO_CACHE_SHARE
from offload.quant.choice import LayoutChoice, LayoutChoosers
from offload.quant.layouts import int4_cpu_layout, int4_cuda_layout, packing_of
from offload.quant.packed_modules import ALIASES

ACCEPTED = (
    "a folder with safetensors or pytorch_model*.bin weights, a .gguf file, or a Hugging "
    "Face id such as HuggingFaceTB/SmolLM2-135M-Instruct"
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_EXTRA_FILES = ("*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja")  # config, tokenizer
_CONVERTED = "converted"
# Part of the key: a change in how we convert converts again (2: 5- and 6-bit types as q8;
# 3: a .gguf's blocks read in place, tensors in forward order).
_VERSION = "3"


def resolve_model(
    model: str | Path | None,
    offload_folder: str | Path | None = None,
    *,
    quantization: str | None = None,
    device: torch.device | None = None,
    kernels: str | None = None,
    layout_chooser: LayoutChoosers | None = None,
    mapped: DiskOffloadConfig | None = None,
) -> Path:
    """The local folder `model` names (see the module's docstring); conversions go into
    `offload_folder` when given, else into the offload cache. `quantization="gguf"` keeps
    a GGUF's tensors as stored (`gguf_stored.py`) instead of converting them to float32,
    laid out for `kernels` ("cpu", "cuda" or "gguf"; by default the kernels of `device`
    where torch has an int4 kernel there: `kernels_for`), each weight's layout chosen by
    `layout_chooser(kernels)` (`probes/layout_choice.LayoutChooser`: the CPU's and the
    GPU's kernels need one; GGUF's blocks have one layout and need none). `mapped`: the
    disk tier of a CPU, which maps files whose matrices are aligned (`aligned_copy.py`)."""
    if model is None and quantization is None:
        return default_model_path()
    into = Path(offload_folder).expanduser() if offload_folder else cache_dir() / _CONVERTED
    path = gguf_path() if model is None else Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        if quantization not in (None, "gguf"):
            raise ModelError(
                f"quantization={quantization!r} needs a checkpoint quantized that way; {path} "
                "is a .gguf (quantization='gguf' or None reads it)"
            )
        if quantization == "gguf":
            kernels = kernels or kernels_for(device)
            packing = packing_of(kernels)  # (the folder names the packing it holds)
            stored = f"{path.stem}.stored" + (f"-{packing}" if packing else "")
            chooser = layout_chooser(kernels) if layout_chooser is not None else None
            write = functools.partial(_stored_gguf, path, kernels=kernels, chooser=chooser)
            return _converted(into, stored, [path], write)
        return _converted(into, path.stem, [path], lambda out: _from_gguf(path, out))
    if quantization is not None:
        _check_quantized_as(path, quantization)
    if path.is_dir():
        return _local_folder(path, into, mapped)
    if path.exists():
        raise ModelError(f"{path} is not a model: give {ACCEPTED}")
    if _HUB_ID.match(str(model)) and not str(model).startswith("."):
        return _local_folder(_hub_snapshot(str(model)), into, mapped)
    return path  # the loader says what is missing


def stored_unless_asked(
    model: str | Path | None, quantization: str | None, dtype: object, device: torch.device
) -> str | None:
    """The `quantization=` a model runs with when the caller named none: as vLLM reads a
    .gguf as GGUF, a .gguf (the default model's included) keeps its weights as stored on a
    CPU or GPU where torch has an int4 kernel (each weight's layout is then measured there);
    an explicit `dtype` ("float32", ...) asks for the old de-quantized float32 conversion
    instead, and so does a file that cannot be read as stored (with a warning saying why)."""
    if quantization is not None or dtype not in (AUTO, None):
        return quantization
    kernel = {"cpu": int4_cpu_layout, "cuda": int4_cuda_layout}.get(device.type)
    path = Path(model).expanduser() if model is not None else None
    is_gguf = path is None or (path.suffix == ".gguf" and path.is_file())
    if not is_gguf or kernel is None or kernel() is None:
        return None
    why = None if path is None else _not_read_as_stored(path)
    if why is not None:
        warnings.warn(f"{path}: {why}; running its float32 conversion", UserWarning, stacklevel=3)
        return None
    return "gguf"


def _not_read_as_stored(path: Path) -> str | None:
    from offload.model.gguf_stored import not_read_as_stored

    try:
        return not_read_as_stored(path)
    except Exception:  # (not a GGUF file at all: the conversion says so in its own words)
        return None


def _local_folder(path: Path, into: Path, mapped: DiskOffloadConfig | None = None) -> Path:
    if (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file():
        stored = checkpoint_tensors(path) if mapped is not None else {}
        if not stored or not _copy_to_map(stored, mapped):
            return path
        sources = sorted(p for p in path.iterdir() if p.is_file())
        name = f"{path.name}.aligned"
        return _converted(into, name, sources, lambda out: write_aligned(path, stored, out))
    bins = sorted(path.glob("pytorch_model*.bin"))
    if bins:
        sources = bins + sorted(p for p in path.iterdir() if p.is_file() and p not in bins)
        return _converted(into, path.name, sources, lambda out: _from_bin(path, bins, out))
    return path  # config only (dummy weights, inspect), or the loader's error


def _copy_to_map(stored: Mapping[str, StoredTensor], disk: DiskOffloadConfig) -> bool:
    """Whether the disk tier `disk` on a CPU would map a checkpoint of tensors `stored`
    (asked to, or "auto" where part of it streams and it fits the page cache's share), and
    can only once its matrices are aligned in files of its own."""
    if disk.disk_io not in (DiskIO.AUTO, DiskIO.MMAP):
        return False
    if any(t.path.suffix != ".safetensors" for t in stored.values()):
        return False  # (references into a .gguf: they stay where they are)
    weights = sum(t.num_bytes for t in stored.values())
    streams = disk.cpu_memory_gb * 2**30 < weights <= AUTO_CACHE_SHARE * available_ram_bytes()
    if disk.disk_io == DiskIO.AUTO and not streams:
        return False
    return misaligned_matrices(stored) > 0


# -- the Hugging Face cache ------------------------------------------------------


def _hub_snapshot(repo: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")
    cache = _hub_cache()
    try:
        for weights in (["*.safetensors"], ["pytorch_model*.bin"]):
            folder = Path(
                snapshot_download(
                    repo,
                    allow_patterns=[*weights, *_EXTRA_FILES],
                    cache_dir=cache,
                    local_files_only=offline,
                )
            )
            if any(folder.glob(weights[0])):
                return folder
    except LocalEntryNotFoundError:
        raise ModelError(
            f"{repo} is not in the local Hugging Face cache ({cache}) and HF_HUB_OFFLINE is "
            "set: download it once with the network on, or give a local folder"
        ) from None
    except RepositoryNotFoundError:
        raise ModelError(
            f"{repo}: no such model on the Hugging Face hub (or it is private: set HF_TOKEN)"
        ) from None
    except (OSError, ValueError) as error:  # no network, HTTP errors, a bad id
        raise ModelError(f"could not get {repo} from the Hugging Face hub: {error}") from None
    return folder  # no weights in it: the loader says so


def _hub_cache() -> str:
    """transformers' cache folder, read now (the hub library reads it at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return os.path.join(home, "hub")


# -- conversions, once -----------------------------------------------------------


def _key(sources: list[Path]) -> str:
    digest = hashlib.sha256(_VERSION.encode())
    for source in sources:
        stat = source.stat()
        digest.update(f"{source.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def _converted(
    folder: Path, name: str, sources: list[Path], convert: Callable[[Path], None]
) -> Path:
    """`convert(staging)` once per version of `sources`, into `folder`. An entry that is
    not a whole conversion (no config.json, or a file in its place), or whose signature
    does not check (`cache_digest`), is thrown away with one warning and converted again."""
    target = folder / f"{name}-{_key(sources)}"
    lock_path = folder / f".{target.name}.lock"
    try:
        _trust(folder)
        if entry_not_usable(target) is None:
            return target
        lock = _lock(lock_path)  # waits while another process converts
    except OSError as error:
        raise ModelError(f"cannot write converted weights to {folder}: {error.strerror}") from None
    try:
        why = entry_not_usable(target)  # (None: another process finished while we waited)
        if why is not None:
            try:
                _throw_away(target, why)
            except OSError as error:
                raise ModelError(
                    f"{target} is a damaged conversion that cannot be removed "
                    f"({error.strerror or error}); remove it by hand"
                ) from None
            _remove_killed(folder, target)
            staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=folder))
            try:
                convert(staging)
                sign_entry(staging, target.name)
                staging.rename(target)
            except (OSError, ValueError, RuntimeError, ImportError, SafetensorError) as error:
                why = conversion_failure(error).removeprefix(f"{sources[0]}: ")  # (named once)
                raise ModelError(f"converting {sources[0]} to safetensors failed: {why}") from None
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    finally:
        with contextlib.suppress(OSError):
            lock_path.unlink()  # under the lock: a waiter sees it gone and locks anew
        os.close(lock)
    return target


def _lock(path: Path) -> int:
    """An exclusive lock on `path`, held until the descriptor is closed. The holder
    removes the file before it lets go (so no lock file stays behind): a waiter that then
    gets the lock of a removed file opens the path again."""
    while True:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            if os.fstat(descriptor).st_ino == os.stat(path).st_ino:
                return descriptor
        except FileNotFoundError:
            pass  # removed by the holder we waited for
        except BaseException:
            os.close(descriptor)
            raise
        os.close(descriptor)


def _remove_killed(folder: Path, target: Path) -> None:
    """Staging folders of `target` left by conversions that were killed (only under the
    lock: no live process writes one then; a kill leaves a staging folder, never `target`)."""
    for leftover in folder.glob(f".{glob.escape(target.name)}-*"):
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)


def _trust(folder: Path) -> None:
    """The folder conversions go into, made and checked (`UntrustedCacheError` where
    another user could write to it): the cache's own, or the offload folder given."""
    if folder == cache_dir() / _CONVERTED:
        cache_folder(_CONVERTED)
        return
    fix = "give --offload-folder (offload_folder=) a folder of your own"
    trusted_folder(folder, fix, name="the offload folder")
    cache_key()  # (what signs the conversions)


def _throw_away(target: Path, why: str) -> None:
    """A conversion entry that is not used (only under the lock): removed, with one warning
    saying `why` ("": there is none)."""
    if not why:
        return
    warnings.warn(f"{target} {why}; converting again", UserWarning, stacklevel=4)
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)
    else:
        target.unlink()


def _from_gguf(source: Path, out: Path) -> None:
    from offload.model.gguf_float import save_as_float

    save_as_float(source, out)


def _stored_gguf(source: Path, out: Path, kernels: str, chooser: LayoutChoice | None) -> None:
    from offload.model.gguf_checks import check_gguf_header
    from offload.model.gguf_stored import save_as_stored

    check_gguf_header(source)
    save_as_stored(source, out, kernels, chooser=chooser)


def kernels_for(device: torch.device | None) -> str:
    """GGUF weights go to torch's int4 kernel of the device they run on where it has one
    (the CPU's; a GPU's from sm_80); elsewhere they stay in GGUF's blocks and are
    de-quantized per forward."""
    if device is None or device.type == "cpu":
        return "cpu" if int4_cpu_layout() is not None else "gguf"
    return "cuda" if device.type == "cuda" and int4_cuda_layout() is not None else "gguf"


def _check_quantized_as(path: Path, quantization: str) -> None:
    """A folder given with `quantization=` must hold weights quantized that way."""
    import json

    try:
        settings = json.loads((path / "config.json").read_text())
        method = settings.get("quantization_config", {}).get("quant_method")
    except (OSError, ValueError, AttributeError):
        return  # (the loader says what is wrong with the folder)
    wanted = ALIASES.get(quantization, quantization)
    if ALIASES.get(method, method) != wanted:
        held = f"quant_method {method}" if method else "not quantized"
        needs = f"a checkpoint whose config.json says quant_method {wanted}"
        if quantization == "gguf":
            needs = "a .gguf file or a folder offload made from one"
        raise ModelError(f"quantization={quantization!r} needs {needs}; {path} is {held}")
