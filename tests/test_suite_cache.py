"""The suite works in a cache folder of its own (tests/conftest.py), never the user's."""

import os
import tempfile
from pathlib import Path

from offload.model.cache_folder import cache_dir


def test_the_suite_has_a_cache_folder_of_its_own(pytestconfig):
    folder = Path(os.environ["OFFLOAD_CACHE_DIR"])
    assert cache_dir() == folder == Path(pytestconfig.offload_cache_dir)
    assert folder.parent == Path(tempfile.gettempdir())
    assert folder.name.startswith("offload-test-cache-")
    user = pytestconfig.offload_user_cache_dir
    assert folder != Path.home() / ".cache" / "offload" and str(folder) != user
