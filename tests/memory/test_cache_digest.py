"""What the cache holds is used only with its signature: small files signed whole,
converted entries by their manifest (sizes, stat, whole and end hashes)."""

import os

import pytest

from offload.memory import cache_digest
from offload.memory.cache_digest import (
    MANIFEST,
    NotSigned,
    check_entry,
    read_signed,
    sign_entry,
    sign_file,
    write_signed,
)


@pytest.fixture(autouse=True)
def root(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(folder))
    return folder


def test_a_signed_file_reads_back_and_a_changed_one_does_not(tmp_path):
    path = tmp_path / "a.json"
    write_signed(path, b'{"x": 1}')
    assert read_signed(path) == b'{"x": 1}'
    path.write_bytes(b'{"x": 2}')
    with pytest.raises(NotSigned, match="does not match"):
        read_signed(path)
    sign_file(path)  # (signed as it is now)
    assert read_signed(path) == b'{"x": 2}'


def test_a_file_without_its_signature_or_with_anothers_is_not_read(tmp_path):
    first, second = tmp_path / "a.pt2", tmp_path / "b.pt2"
    first.write_bytes(b"step a")
    with pytest.raises(NotSigned, match="no signature"):
        read_signed(first)
    second.write_bytes(b"step b")
    sign_file(second)
    first.write_bytes(b"step b")  # the same bytes under another name: not its signature
    cache_digest.digest_path(second).rename(cache_digest.digest_path(first))
    with pytest.raises(NotSigned, match="does not match"):
        read_signed(first)


def test_a_signature_made_with_another_key_does_not_check(tmp_path, monkeypatch):
    path = tmp_path / "a.pt2"
    path.write_bytes(b"step")
    sign_file(path)
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "another-cache"))
    with pytest.raises(NotSigned, match="does not match"):
        read_signed(path)


def _entry(tmp_path, name="model-1234"):
    """A converted entry, signed."""
    entry = tmp_path / name
    (entry / "sub").mkdir(parents=True)
    (entry / "model.safetensors").write_bytes(bytes(range(256)) * 12_000)  # > 2 MiB
    (entry / "config.json").write_text("{}")
    (entry / "sub" / "tokenizer.json").write_text("{}")
    sign_entry(entry, entry.name)
    return entry


def test_a_signed_entry_checks_and_leaves_nothing_beside_it(tmp_path):
    entry = _entry(tmp_path)
    check_entry(entry)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", entry.name]
    assert (entry / MANIFEST).is_file()


def _rewrite_keeping_mtime(path, data):
    info = path.stat()
    path.write_bytes(data)
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))


@pytest.mark.parametrize("where", [0, 1_500_000, -1])
def test_a_swapped_file_of_the_same_size_and_mtime_is_found(tmp_path, where):
    """In place (same inode, mtime set back): its ctime moved, so it is hashed whole, the
    middle too."""
    entry = _entry(tmp_path)
    path = entry / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[where] ^= 0xFF
    _rewrite_keeping_mtime(path, bytes(data))
    with pytest.raises(NotSigned, match=r"model\.safetensors was changed since it was signed"):
        check_entry(entry)


def test_a_file_of_the_same_stat_is_checked_at_its_ends(tmp_path, monkeypatch):
    """Where the stat is as signed (only root could make that so), the first and last MiB
    are hashed again."""
    entry = _entry(tmp_path)
    path = entry / "model.safetensors"
    stamp = cache_digest._stamp(path.stat())
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    _rewrite_keeping_mtime(path, bytes(data))
    monkeypatch.setattr(cache_digest, "_stamp", lambda info: stamp)
    with pytest.raises(NotSigned, match=r"model\.safetensors is not as signed"):
        check_entry(entry)


def test_a_chmod_rehashes_once_and_signs_the_new_stat_in(tmp_path, monkeypatch):
    entry = _entry(tmp_path)
    (entry / "config.json").chmod(0o600)  # its ctime moves; the content is as signed
    check_entry(entry)
    hashed = []
    monkeypatch.setattr(cache_digest, "_sha256", lambda path: hashed.append(path))
    check_entry(entry)
    assert hashed == []  # (signed in: not hashed whole again)


def test_an_extra_a_missing_or_a_linked_file_is_refused(tmp_path):
    entry = _entry(tmp_path)
    (entry / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(NotSigned, match=r"extra \['model.safetensors.index.json'\]"):
        check_entry(entry)
    (entry / "model.safetensors.index.json").unlink()
    (entry / "config.json").unlink()
    with pytest.raises(NotSigned, match=r"missing \['config.json'\]"):
        check_entry(entry)
    (entry / "config.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(NotSigned, match=r"config\.json is not a regular file"):
        check_entry(entry)


def test_another_entrys_manifest_or_a_forged_one_is_refused(tmp_path):
    first, second = _entry(tmp_path, "a-1"), _entry(tmp_path, "b-2")
    (second / MANIFEST).write_bytes((first / MANIFEST).read_bytes())
    with pytest.raises(NotSigned, match="signature is the entry a-1's"):
        check_entry(second)
    (second / MANIFEST).write_text('{"entry": "b-2", "files": {}, "hmac": "00"}')
    with pytest.raises(NotSigned, match="does not match"):
        check_entry(second)
    (second / MANIFEST).unlink()
    with pytest.raises(NotSigned, match="no signature"):
        check_entry(second)
