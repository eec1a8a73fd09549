"""Signatures of what the offload cache holds (HMAC-SHA256 with the cache's key,
`cache_trust`): nothing is unpickled or mapped before its signature checks. A file or
entry that does not check is not used (`NotSigned` says why); its caller makes it again.

A small file (a compiled step, ~6 MB; a probe's JSON) is signed whole: the HMAC of its
name and bytes, in `<name>.digest` beside it. It is read into memory once, checked, and
loaded from those bytes: nothing is read a second time that could differ.

A converted entry (a folder of safetensors, config and tokenizer, up to tens of GB) is
signed by its manifest, `offload.digest` in it: each file's relative name, size, the
sha256 of its whole content (read back once after the conversion wrote it, from the page
cache: a fraction of the conversion's time), its inode, mtime and ctime; and the HMAC of
all that with the entry's name. A load checks the HMAC, that the folder holds exactly the
signed files (regular files: no link, none more, none less), each of its signed size, and
hashes each one's first and last MiB again (a safetensors header is in the first). The
whole content is not hashed at each load, which would read every weight once more: the
stat stands for it. Any write, chmod or rename of a file sets its ctime to now, and no
process but root's can set a ctime back (utime sets the mtime only); so a file whose
inode, mtime and ctime are as signed was not changed since, unless by root, who can also
read the key. This is the second line: to write there at all, another user needs a folder
the trust check let through. A file whose stat changed (a chmod, a restore from a backup)
is hashed whole: as signed, its new stat is signed in; else the entry is not used.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import platform
import stat
import tempfile
from pathlib import Path

from offload.memory.cache_trust import cache_key

DIGEST_SUFFIX = ".digest"
MANIFEST = "offload.digest"
_MIB = 2**20


class NotSigned(Exception):
    """A cached file or entry that is not used; the message says why."""


# -- small files, signed whole ---------------------------------------------------


def _file_mac(key: bytes, name: str, data: bytes) -> str:
    mac = hmac.new(key, b"offload file 1\0" + name.encode() + b"\0", hashlib.sha256)
    mac.update(data)
    return mac.hexdigest()


def digest_path(path: Path) -> Path:
    return path.with_name(path.name + DIGEST_SUFFIX)


def sign_file(path: Path) -> None:
    """Sign the file at `path` as it is now (written by another library: torch's)."""
    _write_whole(digest_path(path), _file_mac(cache_key(), path.name, path.read_bytes()))


def write_signed(path: Path, data: bytes) -> None:
    """`data` at `path`, signed (each written whole or not at all)."""
    _write_whole(path, data)
    _write_whole(digest_path(path), _file_mac(cache_key(), path.name, data))


def read_signed(path: Path) -> bytes:
    """The bytes at `path`, checked against their signature; FileNotFoundError where there
    is no file, `NotSigned` where it does not check."""
    data = path.read_bytes()
    try:
        signed = digest_path(path).read_text().strip()
    except OSError:
        raise NotSigned("it carries no signature (made by an older version?)") from None
    if not hmac.compare_digest(signed, _file_mac(cache_key(), path.name, data)):
        raise NotSigned("its signature does not match (not made by this cache, or changed)")
    return data


def _write_whole(path: Path, data: bytes | str) -> None:
    raw = data.encode() if isinstance(data, str) else data
    descriptor, partial = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(raw)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise


# -- converted entries, signed by their manifest -------------------------------


def sign_entry(folder: Path, name: str) -> None:
    """Sign the entry in `folder` (a staging folder, renamed to `name` once signed)."""
    files = {}
    for relative, info in _files(folder).items():
        whole = _sha256(folder / relative)
        ends = _ends(folder / relative, info.st_size)
        files[relative] = [info.st_size, whole, ends, *_stamp(info)]
    _write_manifest(folder, name, files)


def check_entry(folder: Path) -> None:
    """`NotSigned` unless `folder` holds what was signed into it (see the docstring)."""
    signed = _signed_manifest(folder)
    present = _files(folder)
    missing, extra = sorted(set(signed) - set(present)), sorted(set(present) - set(signed))
    if missing or extra:
        raise NotSigned(f"it holds other files than were signed (missing {missing}, extra {extra})")
    restamped = False
    for relative, (size, whole, ends, *stamp) in signed.items():
        info, path = present[relative], folder / relative
        if info.st_size != size:
            raise NotSigned(f"{relative} has {info.st_size} bytes, signed with {size}")
        if _stamp(info) == stamp:
            if _ends(path, size) != ends:
                raise NotSigned(f"{relative} is not as signed")
        elif _sha256(path) == whole:
            signed[relative][3:] = _stamp(info)
            restamped = True
        else:
            raise NotSigned(f"{relative} was changed since it was signed")
    if restamped:  # (a chmod, a restore): its new stat signed in, best effort
        with contextlib.suppress(OSError):
            _write_manifest(folder, folder.name, signed)


def _signed_manifest(folder: Path) -> dict[str, list]:
    try:
        document = json.loads((folder / MANIFEST).read_text())
        name, files, mac = document["entry"], document["files"], document["hmac"]
    except FileNotFoundError:
        raise NotSigned("it carries no signature (made by an older version?)") from None
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        raise NotSigned("its signature is unreadable") from None
    if not hmac.compare_digest(str(mac), _entry_mac(name, files)):
        raise NotSigned("its signature does not match (not made by this cache, or changed)")
    if name != folder.name:  # (signed by us, for another source)
        raise NotSigned(f"its signature is the entry {name}'s")
    return files  # (ours: the HMAC checked)


def _write_manifest(folder: Path, name: str, files: dict[str, list]) -> None:
    document = {"entry": name, "files": files, "hmac": _entry_mac(name, files)}
    # Written beside the entry and moved in: a reader never sees a file it did not sign.
    descriptor, partial = tempfile.mkstemp(prefix=f".{name}.digest-", dir=folder.parent)
    try:
        with os.fdopen(descriptor, "w") as file:
            json.dump(document, file)
        os.replace(partial, folder / MANIFEST)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise


def _entry_mac(name: str, files: object) -> str:
    text = json.dumps({"entry": name, "files": files}, sort_keys=True)
    return hmac.new(cache_key(), b"offload entry 1\0" + text.encode(), hashlib.sha256).hexdigest()


def _files(folder: Path) -> dict[str, os.stat_result]:
    """Every file under `folder` but the manifest, by relative name; `NotSigned` for a
    link or anything but a folder or a regular file."""
    files = {}
    for top, folders, names in os.walk(folder):
        for name in folders + names:
            path = Path(top) / name
            info = os.lstat(path)
            if stat.S_ISDIR(info.st_mode):
                continue
            if not stat.S_ISREG(info.st_mode):
                raise NotSigned(f"{path.relative_to(folder)} is not a regular file")
            files[path.relative_to(folder).as_posix()] = info
    files.pop(MANIFEST, None)
    return files


def _stamp(info: os.stat_result) -> list[int]:
    return [info.st_ino, info.st_mtime_ns, info.st_ctime_ns]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_MIB):
            digest.update(chunk)
    return digest.hexdigest()


def _ends(path: Path, size: int) -> str:
    """The sha256 of a file's first and last MiB (all of it, if that small)."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        digest.update(file.read(_MIB))
        if size > 2 * _MIB:
            file.seek(size - _MIB)
        digest.update(file.read(_MIB))
    return digest.hexdigest()


def cpu_identity() -> str:
    """The CPU's flags (or model): what a build kept for this machine depends on (compiled
    steps, `-march=native` kernels)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features", "model name")):
                return line
    except OSError:
        pass
    return platform.processor()
