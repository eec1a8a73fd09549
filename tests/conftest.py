import pytest
import torch
from hypothesis import settings

# No per-example deadline: on a loaded 2-core machine a fast example can take a second, and
# a deadline would then fail (or call "flaky") a test that found nothing wrong.
settings.register_profile("offload", deadline=None)
settings.load_profile("offload")

from offload.offloader.base import NoopOffloader, set_offloader


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _reset_global_offloader():
    yield
    set_offloader(NoopOffloader())


@pytest.fixture(scope="session")
def smollm2_path():
    from offload.model.default import default_model_path

    return default_model_path()
