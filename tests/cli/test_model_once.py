"""`offload generate` runs the model preamble once: the CLI makes the `ModelSpec` and
hands it to the `LLM`, which does not resolve the model again."""

import sys

from offload.cli.main import main


def _counted(monkeypatch, name: str, module_name: str) -> list[object]:
    """Every `offload` module's `name` (the function of `module_name`) wrapped to count
    its calls."""
    import importlib

    real = getattr(importlib.import_module(module_name), name)
    calls: list[object] = []

    def counted(*args, **kwargs):
        calls.append(args[0] if args else None)
        return real(*args, **kwargs)

    for module in list(sys.modules.values()):
        if module.__name__.startswith("offload") and getattr(module, name, None) is real:
            monkeypatch.setattr(module, name, counted)
    return calls


def test_generate_resolves_and_builds_the_model_once(smollm2_path, monkeypatch, capsys):
    import offload.cli.commands  # noqa: F401  (every module that may resolve, imported)

    resolved = _counted(monkeypatch, "resolve_model", "offload.model.sources")
    built = _counted(monkeypatch, "make_model_spec", "offload.model.spec")
    assert main(["generate", "--max-tokens", "2", "--no-progress"]) == 0
    assert "tokens in" in capsys.readouterr().out.splitlines()[-1]
    assert len(resolved) == 1 and len(built) == 1, (resolved, built)
