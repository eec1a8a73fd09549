import pytest
import zoo


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory):
    """A 4-layer tiny Llama checkpoint (safetensors) with a word tokenizer."""
    path = tmp_path_factory.mktemp("bench") / "tiny-llama"
    return zoo.save_with_tokenizer(zoo.build("llama", num_layers=4), path)
