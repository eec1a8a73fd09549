"""Configs of well-known model shapes, for `load_format="dummy"` runs without a checkpoint
(the shapes of public models: sizes only, no weights). Each is a folder with config.json."""

from pathlib import Path

CONFIGS = Path(__file__).parent


def shipped() -> list[str]:
    return sorted(p.name for p in CONFIGS.iterdir() if (p / "config.json").is_file())


def resolve(model: str | Path) -> Path:
    """A model directory: `model` itself if it exists, else a shipped config of that name."""
    path = Path(model)
    if not path.exists() and (CONFIGS / str(model) / "config.json").is_file():
        return CONFIGS / str(model)
    return path
