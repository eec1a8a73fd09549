"""Compiled CPU decode steps kept on disk, so that a second process neither traces nor
compiles (`cpu_step`).

Inductor caches its kernels, but dynamo traces the step again in each process: seconds of
Python for the default model's 30 layers (transformers' modules, config look-ups), most of
the time a step takes with the kernels loaded. torch's ahead-of-time compile
(`aot_compile`) keeps dynamo's output too, and a saved step loads in a fraction of that
(docs/benchmarks.md).

Its guards are only the portable ones (each input tensor's size, stride and dtype): what
dynamo would also guard (the model's classes, its config's values, the hooks around its
layers, the offloader each custom op names) is folded into the file's name instead
(`fingerprint`), with the versions of Python, torch, transformers and this package's own
source, the CPU, the thread count and which inputs share storage. Anything that changes
one of them reads another file (or compiles one); a file that is unreadable, fails its
guards or does not load is left aside and the step is compiled as without the cache.
The folder keeps the `KEPT` most recently used steps (`prune`, at each save).

Loading a step unpickles it, which can run any code: the folder is used only when it is
the user's own (`memory.cache_trust`), and a step only when its signature checks
(`memory.cache_digest`): read into memory, checked, then unpickled from those bytes. A
step that does not check is compiled again, with a log line saying why.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import io
import json
import logging
import os
import platform
import sys
from pathlib import Path

import torch
from torch.utils.hooks import RemovableHandle

from offload.errors import UntrustedCacheError
from offload.memory import cache_digest
from offload.memory.cache_trust import cache_folder, cache_root, trusted_folder
from offload.offloader.unit_check import UnitReadCheck

log = logging.getLogger(__name__)

VERSION = 1  # of the saved files' naming: raise it when what a step depends on grows
ALIGNMENT = 64  # bytes: the widest alignment inductor's kernels may assume of an input


FOLDER = "compiled-steps"


def folder() -> Path:
    """Where steps are kept: made and checked (`UntrustedCacheError` where another user
    could write there); a folder that cannot be made is only named (nothing loads from
    it, and saving there logs)."""
    try:
        return cache_folder(FOLDER)
    except OSError as error:
        log.info("the compiled steps' folder cannot be made (%s): none are kept", error)
        return cache_root() / FOLDER


def keepable(step) -> bool:
    """Whether the step can be kept: not where module units' read checks bracket layers
    (their offloader's slots and locks are in the guards' state, which does not pickle;
    prefetch hooks and KV offload's layers name theirs by id) nor with a cache that is not
    transformers' (its classes unknown here). Known before compiling, which `aot_compile`
    would only find after it (a second compile)."""
    for module in step._model.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            if any(isinstance(getattr(h, "__self__", None), UnitReadCheck) for h in hooks.values()):
                return False
    caches = [value for value in step._cache.values() if value is not None]
    return all(type(cache).__module__.startswith("transformers.") for cache in caches)


def _parts(step, extra: str) -> list:
    parts = [f"v{VERSION}", extra, _environment(), torch.get_num_threads()]
    parts += [torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
    model = step._model
    parts.append(_source_of(type(model)))
    parts.append(getattr(model.config, "_attn_implementation", None))
    config = json.loads(model.config.to_json_string(use_diff=False))
    config.pop("_name_or_path", None)  # where it was read from: no trace reads it
    parts.append(json.dumps(config, sort_keys=True))
    storages: dict[int, int] = {}
    for name, module in model.named_modules():
        parts.append((name, _qualname(type(module)), _forward_of(module)))
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            parts.extend(_describe(hook) for hook in hooks.values())
        for tensor_name, tensor in [*module._parameters.items(), *module._buffers.items()]:
            parts.append((tensor_name, _tensor(tensor, storages)))
    for key, value in sorted(step._cache.items()):
        parts.append((key, _describe(value, storages, depth=3)))
    for tensor in (step.mask, step.input_ids, step.position_ids, step.cache_position):
        parts.append(_tensor(tensor, storages))
    return parts


def fingerprint(step, extra: str) -> str:
    """A digest of everything a traced decode step depends on besides its input tensors'
    sizes, strides and dtypes (which the saved step's guards check), and `extra` (the
    shape, the graph passes' source)."""
    return hashlib.sha256(repr(_parts(step, extra)).encode()).hexdigest()[:32]


@functools.cache
def _environment() -> str:
    import transformers

    return repr(
        (
            sys.version,
            torch.__version__,
            transformers.__version__,
            platform.machine(),
            cache_digest.cpu_identity(),
            _package_digest(),
        )
    )


def _package_digest() -> str:
    """This package's source, every file (a change anywhere may change what is traced)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _source_of(cls: type) -> str:
    """The digest of the file defining `cls` (transformers' or remote code's modeling)."""
    try:
        return hashlib.sha256(Path(inspect.getfile(cls)).read_bytes()).hexdigest()
    except (OSError, TypeError):
        return _qualname(cls)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _forward_of(module: torch.nn.Module) -> str | None:
    """A forward set on the instance (a wrapper), else None (its class's)."""
    forward = module.__dict__.get("forward")
    return None if forward is None else _describe(forward)


_PLAIN = (int, float, str, bool, type(None), torch.dtype, torch.device)


def _describe(value, storages: dict[int, int] | None = None, depth: int = 1):
    """What of `value` a trace can bake in: its type and its plain attributes (numbers,
    strings, their collections; a tensor's layout), `depth` objects deep."""
    storages = {} if storages is None else storages
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, torch.Tensor):
        return _tensor(value, storages)
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_describe(item, storages, depth) for item in value]
        if isinstance(value, (set, frozenset)):
            items = sorted(map(repr, items))
        return (type(value).__name__, items)
    if isinstance(value, dict):
        return sorted((repr(k), repr(_describe(v, storages, depth))) for k, v in value.items())
    if inspect.ismethod(value):
        return (value.__qualname__, _describe(value.__self__, storages, depth))
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    described = [_qualname(type(value))]
    if depth > 0 and hasattr(value, "__dict__"):
        for name, attr in sorted(vars(value).items()):
            if isinstance(attr, (torch.nn.Module, RemovableHandle)):
                continue  # modules are described on their own; a handle's id is a count
            described.append((name, _describe(attr, storages, depth - 1)))
    return described


def _tensor(tensor: torch.Tensor, storages: dict[int, int]):
    """A tensor's layout, which of the tensors seen so far share its storage, and how its
    first byte is aligned (what inductor's kernels assume of an input's address; not its
    offset in its storage, which for a slot's views depends on where the allocator put
    the slot, so the same model's step would be named anew in each LLM)."""
    if tensor is None:
        return None
    try:
        storage = storages.setdefault(tensor.untyped_storage().data_ptr(), len(storages))
        alignment = tensor.data_ptr() % ALIGNMENT
    except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage
        storage = alignment = -1
    return (
        _qualname(type(tensor)),
        tuple(tensor.shape),
        tensor.stride(),
        tensor.dtype,
        tensor.device.type,
        alignment,
        storage,
        tensor.requires_grad,
    )


def load(path: Path):
    """The saved step at `path`, or None (absent, unreadable, not signed by this cache, or
    from another torch)."""
    if not path.is_file():
        return None
    try:
        data = cache_digest.read_signed(path)
    except (cache_digest.NotSigned, UntrustedCacheError) as why:
        log.warning("the saved decode step %s is not loaded: %s; compiling it", path, why)
        return None
    except OSError as error:
        log.info("the saved decode step %s cannot be read (%s): compiling it", path, error)
        return None
    try:
        compiled = torch.compiler.load_compiled_function(io.BytesIO(data))
    except Exception as error:  # any failure: compile as without the cache
        log.info("the saved decode step %s did not load (%s): compiling it", path, error)
        return None
    compiled.disable_guard_check()  # checked by the caller, before each call
    with contextlib.suppress(OSError):
        os.utime(path)  # used now: among the last to go when the folder is pruned
    return compiled


def save(compiled, path: Path) -> None:
    """Keep `compiled` at `path` (written whole or not at all), then prune the folder; a
    failure only logs."""
    try:
        trusted_folder(path.parent)
        compiled.save_compiled_function(os.fspath(path))
        cache_digest.sign_file(path)
    except Exception as error:  # the step runs; only the next process pays
        log.info("could not save the decode step to %s (%s)", path, error)
        with contextlib.suppress(OSError):
            path.unlink()  # (unsigned, it would only be refused at each load)
    prune(path.parent)


KEPT = 64  # steps a folder keeps, the most recently used (the default model's: ~6 MB each)


def prune(where: Path, keep: int = KEPT) -> None:
    """Remove all but the `keep` most recently used kept steps (and marks) in `where`:
    every new version of torch, transformers or this package, and every model and
    setting, names its steps anew, and nothing else would ever remove the old ones. A
    step another process is about to load, removed meanwhile, is compiled again there."""
    try:
        kept = [p for p in where.iterdir() if p.suffix in (".pt2", ".traced")]
        kept.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:  # (a file removed meanwhile by another process's prune)
        return
    for old in kept[keep:]:
        with contextlib.suppress(OSError):
            old.unlink()
        with contextlib.suppress(OSError):
            cache_digest.digest_path(old).unlink()


def mark(path: Path) -> None:
    """An empty file at `path` (a failure only logs)."""
    try:
        trusted_folder(path.parent)
        path.touch()
    except (OSError, UntrustedCacheError) as error:
        log.info("could not write %s (%s)", path, error)
