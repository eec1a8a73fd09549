"""What one `LLM(...)` makes once: its offload config is checked once (it is frozen:
nothing checks it again), and its offloader is built once."""

from offload.config import OffloadConfig
from offload.llm.llm import LLM


def test_the_offload_config_is_validated_once(smollm2_path, monkeypatch):
    calls = []
    validate = OffloadConfig.validate

    def counted(config):
        calls.append(config)
        validate(config)

    monkeypatch.setattr(OffloadConfig, "validate", counted)
    LLM(smollm2_path)
    assert len(calls) == 1
