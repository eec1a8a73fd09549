"""The default model's cache folder: leftovers of a killed conversion are removed at the
next start, a conversion under way is left alone (and waited for), and a cache folder
that cannot be one is a one-line error. The conversion itself is faked: no GGUF is read."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from offload.errors import OffloadError
from offload.memory.cache_digest import sign_entry
from offload.model import default

NAME = default.DEFAULT_MODEL_NAME

# A process converting into `cache` (argv[1]) that says where, then takes argv[2] seconds.
CONVERTER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from offload.model import default

    default.gguf_path = lambda: Path("fake.gguf")
    def convert(source, out_dir):
        (out_dir / "model.safetensors").write_bytes(bytes(1 << 20))
        print("converting", out_dir, flush=True)
        time.sleep(float(sys.argv[1]))
        (out_dir / "config.json").write_text("{}")
    default.save_as_float = convert
    print("done", default.default_model_path(), flush=True)
    """
)


@pytest.fixture
def conversions():
    """The staging folders this process's (fake) conversions wrote into."""
    return []


@pytest.fixture
def cache(tmp_path, monkeypatch, conversions):
    """A cache folder, not yet made, and a fake conversion."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(folder))
    monkeypatch.setattr(default, "gguf_path", lambda: tmp_path / "fake.gguf")

    def convert(source, out_dir):
        conversions.append(out_dir)
        (out_dir / "model.safetensors").write_bytes(b"weights")
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(default, "save_as_float", convert)
    return folder


def _converter(folder, seconds):
    """A converting process, started and seen to be writing into its staging folder."""
    process = subprocess.Popen(
        [sys.executable, "-c", CONVERTER, str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OFFLOAD_CACHE_DIR": str(folder)},
    )
    line = process.stdout.readline().split()
    assert line[0] == "converting", line
    return process, Path(line[1])


def _staging(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(f".{NAME}-"))


def test_a_conversion_under_way_is_kept_and_its_leftover_removed_once_killed(cache, conversions):
    process, staging = _converter(cache, 120)
    try:
        # Meanwhile someone else put a converted model in place: starts now find it, and
        # must not touch the live conversion's staging folder.
        (cache / NAME).mkdir()
        (cache / NAME / "model.safetensors").write_bytes(b"weights")
        (cache / NAME / "config.json").write_text("{}")
        sign_entry(cache / NAME, NAME)
        assert default.default_model_path() == cache / NAME
        assert (staging / "model.safetensors").is_file()
    finally:
        process.send_signal(signal.SIGKILL)  # as kill -9: no cleanup of its own
        process.wait()
    assert _staging(cache) == [staging.name]  # the leftover, about to be removed
    assert default.default_model_path() == cache / NAME
    assert _staging(cache) == []
    assert (cache / NAME / "model.safetensors").read_bytes() == b"weights"
    assert conversions == []  # found, not converted


def test_the_next_conversion_removes_leftovers_and_nothing_else(cache, conversions):
    cache.mkdir()
    leftover = cache / f".{NAME}-k1ll3d9x"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(bytes(1024))
    others = [cache / f".{NAME}-a-file", cache / ".other-tool-abc", cache / "notes.txt"]
    others[0].write_text("not a staging folder")
    others[1].mkdir()
    others[2].write_text("mine")
    assert default.default_model_path() == cache / NAME
    assert len(conversions) == 1 and not leftover.exists()
    assert all(p.exists() for p in others)
    assert _staging(cache) == [f".{NAME}-a-file"]  # the staging folder itself is gone


def test_a_second_start_waits_for_the_conversion_under_way(cache, conversions):
    process, staging = _converter(cache, 2)
    result = []
    waiting = threading.Thread(target=lambda: result.append(default.default_model_path()))
    waiting.start()
    waiting.join(timeout=1)
    assert waiting.is_alive()  # blocked on the lock, not converting a second time
    assert process.stdout.readline().split() == ["done", str(cache / NAME)]
    process.wait()
    waiting.join(timeout=60)
    assert result == [cache / NAME] and conversions == []
    assert _staging(cache) == [] and not staging.exists()


def test_a_cache_dir_that_is_a_file_is_one_line(cache):
    cache.write_text("oops")
    with pytest.raises(OffloadError) as info:
        default.default_model_path()
    assert str(info.value) == f"OFFLOAD_CACHE_DIR={cache} is a file; it must name a folder"


def test_a_cache_dir_inside_a_file_is_one_line(cache, monkeypatch):
    cache.write_text("oops")
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(cache / "offload"))
    with pytest.raises(OffloadError) as info:
        default.default_model_path()
    assert str(info.value) == (
        f"OFFLOAD_CACHE_DIR={cache / 'offload'} is inside {cache}, which is a file; "
        "it must name a folder"
    )


def test_an_unwritable_cache_dir_is_one_line(cache, monkeypatch):
    # Permissions do not stop root, who runs some test machines: the refusal is faked.
    def refused(folder, wait):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(default, "_lock", refused)
    with pytest.raises(OffloadError) as info:
        default.default_model_path()
    assert str(info.value) == (
        f"OFFLOAD_CACHE_DIR={cache}: cannot write the default model there (Permission "
        "denied); set OFFLOAD_CACHE_DIR to a writable folder"
    )


def _converted_before(cache):
    """A converted model as an older version left it: no signature."""
    (cache / NAME).mkdir(parents=True)
    (cache / NAME / "model.safetensors").write_bytes(b"old weights")
    (cache / NAME / "config.json").write_text("{}")


def test_a_model_converted_by_an_older_version_is_converted_again(cache, conversions):
    _converted_before(cache)
    with pytest.warns(UserWarning, match=f"{NAME} is not used .*no signature.*; converting again"):
        assert default.default_model_path() == cache / NAME
    assert len(conversions) == 1 and (cache / NAME / "model.safetensors").read_bytes() == b"weights"
    assert default.default_model_path() == cache / NAME and len(conversions) == 1  # signed now


def test_a_signed_model_is_used_without_the_lock(cache, conversions, monkeypatch):
    """A cache that cannot be written (faked: root writes anywhere) still gives its model."""
    assert default.default_model_path() == cache / NAME and len(conversions) == 1

    def refused(folder, wait):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(default, "_lock", refused)
    assert default.default_model_path() == cache / NAME and len(conversions) == 1
