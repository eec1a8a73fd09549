"""The offload cache is read only when it is ours: what it holds (compiled steps, which
are unpickled; converted weights, which are mapped) is as trusted as whoever could write it.

The folders (as ssh's StrictModes checks `~/.ssh`): a cache folder must be owned by the
user and writable by no one else (no group or other write bit); each folder above it, up
to the user's home (included) or up to `/` for a folder outside it, must be owned by the
user or root and writable by no one else, or else sticky (`/tmp`: only an entry's owner
may rename or remove it, so ours stays ours). A group write bit is allowed where the group
is its owner's private one (named as the user, no other member: a umask of 002 with
user-private groups, as Debian's ssh allows). Where a link is on the way, the folder that
holds the link and the folders it leads to are checked alike. Folders made here are made
0700. Anything else is `UntrustedCacheError`: one line naming the folder, its owner or
mode, and the fix.

The key: 32 random bytes in `<cache>/key`, mode 0600, made once per cache (written to a
private file, then linked into place, so no process reads half a key); a key that is not
the user's own, or that others may read, is refused. It signs what the cache holds
(`cache_digest`): a file in a trusted folder that does not carry its signature is never
loaded — made by an older version, copied from elsewhere, or put there while the folder
was still open to others.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import secrets
import stat
import tempfile
from pathlib import Path

from offload.errors import UntrustedCacheError

KEY_NAME = "key"
KEY_BYTES = 32
_ENV = "OFFLOAD_CACHE_DIR"
_YOURS = f"set {_ENV} to a folder of your own"


def cache_root() -> Path:
    """`$OFFLOAD_CACHE_DIR`, else `$XDG_CACHE_HOME/offload`, else `~/.cache/offload`
    (not made, not checked: `cache_folder` does both)."""
    if os.environ.get(_ENV):
        return Path(os.environ[_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "offload"


def cache_folder(*parts: str) -> Path:
    """The cache root, or the folder `parts` inside it, made (0700) and checked, with the
    cache's key made: `UntrustedCacheError` where another user could write to it; an
    OSError where it cannot be made."""
    root = cache_root()
    folder = root.joinpath(*parts)
    trusted_folder(folder, own_up_to=root)
    cache_key()
    return folder


def trusted_folder(
    folder: Path, fix: str = _YOURS, own_up_to: Path | None = None, name: str = "the cache folder"
) -> None:
    """`folder` checked (`check_folder`), made where missing: what exists of it is checked
    first, so nothing is made inside a folder that is not trusted."""
    existing = next(path for path in (folder, *folder.parents) if path.exists())
    check_folder(existing, fix, own_up_to or folder, name)
    make_folder(folder)
    check_folder(folder, fix, own_up_to, name)


def make_folder(folder: Path) -> None:
    """`folder` and any missing folder above it, each made 0700."""
    missing = []
    for path in (folder, *folder.parents):
        if path.is_dir():
            break
        missing.append(path)
    for path in reversed(missing):
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            if not path.is_dir():  # (a file: made meanwhile by another process is a folder)
                raise


def check_folder(
    folder: Path, fix: str = _YOURS, own_up_to: Path | None = None, name: str = "the cache folder"
) -> None:
    """`folder` (and each folder from it up to `own_up_to`) owned by the user and writable
    by no one else; the folders above those owned by the user or root and writable by no
    one else, or sticky. `fix`: how to choose another folder, and `name` what the folder
    is, for the message."""
    top = folder if own_up_to is None else own_up_to
    own = {_real(p) for p in (folder, *folder.parents) if _is_within(p, top)}
    for path in _folders_above(folder):
        _check_one(path, folder, name, is_own=path in own, fix=fix)


def check_inductor_cache() -> None:
    """inductor's cache folder checked as the cache folder is: a compile imports and loads
    the kernels it finds there, and torch's default, `/tmp/torchinductor_<user>`, is a
    name another user can take first."""
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not folder:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        folder = cache_dir()  # torch's default, made (and put in the environment) by torch
    fix = "set TORCHINDUCTOR_CACHE_DIR to a new folder of your own"
    trusted_folder(Path(os.path.abspath(folder)), fix, name="inductor's cache folder")


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _is_within(path: Path, root: Path) -> bool:
    return Path(os.path.abspath(path)).is_relative_to(os.path.abspath(root))


def _folders_above(folder: Path) -> list[Path]:
    """Every folder a lookup of `folder` reads an entry of: each prefix of its path as
    written, resolved, and the folders above that, each up to the user's home."""
    try:
        home = _real(Path.home())
    except (RuntimeError, KeyError):  # (no $HOME and no entry in the user database)
        home = None
    seen: list[Path] = []
    written = Path(os.path.abspath(folder))
    for prefix in (written, *written.parents):
        real = _real(prefix)
        for path in (real, *real.parents):
            if path in seen:
                break
            seen.append(path)
            if path == home:
                break
    return seen


def _check_one(path: Path, folder: Path, name: str, is_own: bool, fix: str) -> None:
    info = os.stat(path)
    me = os.geteuid()
    where = f"{name} {folder}"
    if path != _real(folder):
        where += f" is inside {path}, which"
    if info.st_uid != me and (is_own or info.st_uid != 0):
        whose = "you" if is_own else "you or root"
        raise UntrustedCacheError(
            f"{where} is owned by uid {info.st_uid}, not by {whose} (uid {me}): {fix}"
        )
    sticky = info.st_mode & stat.S_ISVTX and not is_own
    if _writable_by_others(info) and not sticky:
        mode = stat.S_IMODE(info.st_mode)
        raise UntrustedCacheError(
            f"{where} is writable by its group or others (mode {mode:04o}): "
            f"chmod go-w {path}, or {fix}"
        )


def _writable_by_others(info: os.stat_result) -> bool:
    """A write bit for others, or for a group that is not its owner's private one (as
    Debian's ssh allows: the group named as the owner, with no other member listed)."""
    if info.st_mode & stat.S_IWOTH:
        return True
    return bool(info.st_mode & stat.S_IWGRP) and not _is_private_group(info.st_gid, info.st_uid)


def _is_private_group(gid: int, uid: int) -> bool:
    try:
        group, user = grp.getgrgid(gid), pwd.getpwuid(uid)
    except KeyError:  # (a number with no name)
        return False
    return group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}


def cache_key() -> bytes:
    """The cache's signing key, made the first time (in a checked cache root)."""
    root = cache_root()
    trusted_folder(root)
    path = root / KEY_NAME
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    descriptor, private = tempfile.mkstemp(prefix=".key-", dir=root)  # O_EXCL, mode 0600
    try:
        os.write(descriptor, secrets.token_bytes(KEY_BYTES))
        os.fsync(descriptor)
        os.close(descriptor)
        with contextlib.suppress(FileExistsError):  # (another process's key is there)
            os.link(private, path)  # in place whole: no reader sees half a key
    finally:
        os.unlink(private)
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    """The key at `path`, refused unless it is the user's, readable by no one else and a
    key's size (a link is refused too: FileNotFoundError only where there is nothing)."""
    remove = "remove it (a new one is made, and what the cache held is made again)"
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as error:
        if isinstance(error, FileNotFoundError):
            raise
        raise UntrustedCacheError(
            f"the cache key {path} cannot be read ({error.strerror}): {remove}"
        ) from None
    try:
        info = os.fstat(descriptor)
        if info.st_uid != os.geteuid():
            raise UntrustedCacheError(
                f"the cache key {path} is owned by uid {info.st_uid}, not by you "
                f"(uid {os.geteuid()}): {remove}"
            )
        if not stat.S_ISREG(info.st_mode) or info.st_mode & 0o077:
            raise UntrustedCacheError(
                f"the cache key {path} has mode {stat.S_IMODE(info.st_mode):04o} (it must be "
                f"0600): chmod 600 {path}, or {remove}"
            )
        key = os.read(descriptor, KEY_BYTES + 1)
    finally:
        os.close(descriptor)
    if len(key) != KEY_BYTES:
        raise UntrustedCacheError(
            f"the cache key {path} holds {len(key)} bytes, not {KEY_BYTES}: {remove}"
        )
    return key
