"""`offload generate` with a cache folder another user could write: one line naming the
folder, what is wrong and the fix; exit 2, no traceback, nothing read from it."""

import os

import pytest

from offload.cli import main

OTHER_UID = 12345


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(folder))
    return folder


def _one_line(err):
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_generate_refuses_a_cache_others_may_write(cache, capsys):
    cache.chmod(0o777)
    assert main(["generate", "--max-tokens", "2"]) == 2
    assert _one_line(capsys.readouterr().err) == (
        f"offload: error: the cache folder {cache} is writable by its group or others (mode "
        f"0777): chmod go-w {cache}, or set OFFLOAD_CACHE_DIR to a folder of your own"
    )
    assert list(cache.iterdir()) == []


def test_generate_refuses_a_cache_of_another_user(cache, capsys):
    os.chown(cache, OTHER_UID, -1)
    assert main(["generate", "--max-tokens", "2"]) == 2
    assert _one_line(capsys.readouterr().err) == (
        f"offload: error: the cache folder {cache} is owned by uid {OTHER_UID}, not by you "
        f"(uid {os.geteuid()}): set OFFLOAD_CACHE_DIR to a folder of your own"
    )
