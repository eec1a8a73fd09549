"""A kept compiled step is unpickled only with its signature: a file planted in the
steps' folder runs nothing (tests/engine/test_cpu_step.py: the step is compiled again)."""

import logging
import pickle

import pytest

from offload.engine import step_cache
from offload.errors import UntrustedCacheError
from offload.memory import cache_digest


class _RunsCode:
    """Unpickled, it would create the file it names."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def steps(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    return step_cache.folder()


def test_a_planted_step_is_not_unpickled(steps, tmp_path, caplog):
    marker = tmp_path / "the code ran"
    planted = steps / "0123.pt2"
    planted.write_bytes(pickle.dumps(_RunsCode(marker)))
    with caplog.at_level(logging.WARNING, logger=step_cache.__name__):
        assert step_cache.load(planted) is None
    assert not marker.exists()
    assert "is not loaded: it carries no signature" in caplog.text
    cache_digest.digest_path(planted).write_text("0" * 64)  # a signature it does not have
    assert step_cache.load(planted) is None and not marker.exists()


def test_signed_the_same_file_would_be_unpickled(steps, tmp_path, monkeypatch):
    """The signature is what stands between the file and the unpickler: signed with this
    cache's key, the planted file runs (so the test above would see it run). torch's
    loader, an unpickler too, is stood in for by pickle's: importing dynamo takes ~15 s."""
    monkeypatch.setattr(step_cache.torch.compiler, "load_compiled_function", pickle.load)
    marker = tmp_path / "the code ran"
    planted = steps / "0123.pt2"
    planted.write_bytes(pickle.dumps(_RunsCode(marker)))
    cache_digest.sign_file(planted)
    with pytest.raises(AttributeError):  # (a file, not a step: run, then its use fails)
        step_cache.load(planted)
    assert marker.exists()


def test_the_steps_folder_is_refused_when_others_may_write_it(steps):
    steps.chmod(0o777)
    with pytest.raises(UntrustedCacheError, match=f"{steps} is writable .* chmod go-w {steps}"):
        step_cache.folder()


def test_pruning_takes_a_steps_signature_with_it(steps):
    for name in ("a.pt2", "b.pt2"):
        cache_digest.write_signed(steps / name, b"step")
    step_cache.prune(steps, keep=1)
    assert len(list(steps.glob("*.pt2"))) == len(list(steps.glob("*.digest"))) == 1
