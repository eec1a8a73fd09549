"""The cache is used only when it is the user's own: its folder and the folders above it
(as ssh's StrictModes), and its key. Tests run as root here, who may chown to any uid."""

import grp
import os
import pwd
import stat

import pytest

from offload.errors import UntrustedCacheError
from offload.memory.cache_trust import (
    KEY_BYTES,
    KEY_NAME,
    cache_folder,
    cache_key,
    check_inductor_cache,
)

OTHER_UID = 12345


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def root(tmp_path, monkeypatch):
    """A cache root, not yet made, inside a folder of the test's own."""
    folder = tmp_path / "home" / "cache"
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(folder))
    return folder


def _refused(match):
    """The one line a refused cache gives."""
    with pytest.raises(UntrustedCacheError, match=match) as info:
        cache_folder("steps")
    assert "\n" not in str(info.value)
    return str(info.value)


def test_folders_are_made_0700_with_a_0600_key_of_32_bytes(root):
    assert cache_folder("steps") == root / "steps"
    for folder in (root.parent, root, root / "steps"):
        assert _mode(folder) == 0o700
    key = root / KEY_NAME
    assert _mode(key) == 0o600 and key.stat().st_uid == os.geteuid()
    assert len(key.read_bytes()) == KEY_BYTES and cache_key() == key.read_bytes()
    assert sorted(p.name for p in root.iterdir()) == [KEY_NAME, "steps"]  # (no private copy)


def test_a_cache_folder_writable_by_others_is_refused_naming_the_fix(root):
    root.mkdir(parents=True)
    root.chmod(0o777)
    line = _refused("writable by its group or others")
    assert line == (
        f"the cache folder {root} is writable by its group or others (mode 0777): "
        f"chmod go-w {root}, or set OFFLOAD_CACHE_DIR to a folder of your own"
    )
    assert list(root.iterdir()) == []  # nothing read, nothing made there


@pytest.mark.parametrize("mode", [0o770, 0o1777])
def test_the_cache_folder_itself_may_not_be_group_writable_nor_sticky(root, mode):
    root.mkdir(parents=True)
    root.chmod(mode)
    os.chown(root, -1, OTHER_UID)  # (a group that is not the user's private one)
    with pytest.raises(UntrustedCacheError, match=f"mode {mode:04o}.*chmod go-w {root}"):
        cache_folder()


def test_a_group_write_bit_for_the_users_private_group_is_allowed(root):
    """A umask of 002 with user-private groups (Debian's): the group is the user alone."""
    root.mkdir(parents=True)
    root.chmod(0o770)
    user = pwd.getpwuid(os.geteuid())
    private = grp.getgrnam(user.pw_name)  # (root's, here: named as the user, no member)
    os.chown(root, -1, private.gr_gid)
    assert cache_folder() == root


def test_a_cache_folder_of_another_user_is_refused(root):
    root.mkdir(parents=True, mode=0o700)
    os.chown(root, OTHER_UID, -1)
    line = _refused(f"owned by uid {OTHER_UID}")
    assert line == (
        f"the cache folder {root} is owned by uid {OTHER_UID}, not by you "
        f"(uid {os.geteuid()}): set OFFLOAD_CACHE_DIR to a folder of your own"
    )


def test_a_subfolder_of_another_user_is_refused(root):
    (root / "steps").mkdir(parents=True, mode=0o700)
    os.chown(root / "steps", OTHER_UID, -1)
    _refused(f"the cache folder {root / 'steps'} is owned by uid {OTHER_UID}, not by you ")


def test_a_parent_writable_by_others_is_refused_a_sticky_one_is_not(root):
    root.mkdir(parents=True)
    root.parent.chmod(0o777)
    _refused(f"inside {root.parent}, which is writable .* \\(mode 0777\\)")
    root.parent.chmod(0o1777)  # as /tmp: only an entry's owner may rename it
    assert cache_folder("steps") == root / "steps"


def test_a_parent_of_another_user_is_refused(root):
    root.mkdir(parents=True)
    os.chown(root.parent, OTHER_UID, -1)
    _refused(f"inside {root.parent}, which is owned by uid {OTHER_UID}, not by you or root")


def test_a_link_in_a_folder_others_may_write_is_refused(tmp_path, monkeypatch):
    """The folder that holds a link could swap it: checked as if on the path."""
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    (shared / "cache").symlink_to(mine)
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(shared / "cache"))
    _refused(f"inside {shared}, which is writable")
    shared.chmod(0o755)
    assert cache_folder("steps") == shared / "cache" / "steps" and (mine / "steps").is_dir()


def test_a_key_others_may_read_is_refused(root):
    cache_folder()
    key = root / KEY_NAME
    key.chmod(0o644)
    with pytest.raises(UntrustedCacheError) as info:
        cache_folder("steps")
    assert str(info.value) == (
        f"the cache key {key} has mode 0644 (it must be 0600): chmod 600 {key}, or remove it "
        "(a new one is made, and what the cache held is made again)"
    )


def test_a_key_of_another_user_a_link_or_short_is_refused(root, tmp_path):
    cache_folder()
    key = root / KEY_NAME
    os.chown(key, OTHER_UID, -1)
    _refused(f"the cache key {key} is owned by uid {OTHER_UID}, not by you")
    key.unlink()
    (tmp_path / "elsewhere").write_bytes(bytes(KEY_BYTES))
    key.symlink_to(tmp_path / "elsewhere")
    _refused(f"the cache key {key} cannot be read")
    key.unlink()
    key.write_bytes(b"short")
    key.chmod(0o600)
    _refused(f"the cache key {key} holds 5 bytes, not {KEY_BYTES}")
    key.unlink()
    assert len(cache_key()) == KEY_BYTES  # removed: a new one is made


def test_inductors_cache_folder_of_another_user_is_refused(tmp_path, monkeypatch):
    """A compile loads the kernels in inductor's cache: its folder is checked alike."""
    folder = tmp_path / "inductor"
    folder.mkdir(mode=0o755)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(folder))
    check_inductor_cache()
    os.chown(folder, OTHER_UID, -1)
    with pytest.raises(UntrustedCacheError) as info:
        check_inductor_cache()
    assert str(info.value) == (
        f"inductor's cache folder {folder} is owned by uid {OTHER_UID}, not by you (uid "
        f"{os.geteuid()}): set TORCHINDUCTOR_CACHE_DIR to a new folder of your own"
    )
