"""The benchmark scripts (benchmarks/*.py) name only what the package and their helpers
still define: a name renamed or removed in `src/` breaks the script that imports it,
which no other test runs (`gpu_decode.py` imported `DecodeGraphs` for five sessions after
it was gone, and would have failed on the next GPU lent). Read from each script's source,
without running it: the scripts build models and time them."""

import ast
import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))


def _top_level_names(path: Path) -> set[str]:
    """What a helper script defines at its top level (functions, classes, assignments,
    imports), read without importing it."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def _missing(script: Path) -> list[str]:
    """The imports of `script` that do not resolve: `offload` modules and their names, and
    names taken from the other scripts beside it (`from common import ...`)."""
    missing = []
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "offload":
                    try:
                        importlib.import_module(alias.name)
                    except ImportError as error:
                        missing.append(f"import {alias.name} ({error})")
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            root = node.module.split(".")[0]
            if root == "offload":
                try:
                    module = importlib.import_module(node.module)
                except ImportError as error:
                    missing.append(f"from {node.module} ({error})")
                    continue
                for alias in node.names:
                    if hasattr(module, alias.name):
                        continue
                    try:  # (a submodule not yet imported)
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        missing.append(f"from {node.module} import {alias.name}")
            elif (BENCHMARKS / f"{root}.py").exists() and root == node.module:
                defined = _top_level_names(BENCHMARKS / f"{root}.py")
                missing += [
                    f"from {root} import {alias.name}"
                    for alias in node.names
                    if alias.name not in defined
                ]
    return missing


def test_there_are_scripts_to_check():
    assert len(SCRIPTS) > 20 and BENCHMARKS / "gpu_decode.py" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=[path.stem for path in SCRIPTS])
def test_each_benchmark_imports_what_exists(script):
    assert _missing(script) == []


def test_a_removed_name_is_found(tmp_path, monkeypatch):
    """The check itself: a script importing a name the package lacks, or one its helper
    lacks, is reported."""
    monkeypatch.setattr(sys.modules[__name__], "BENCHMARKS", tmp_path)
    (tmp_path / "helper.py").write_text("import os\nVALUE = 1\n\ndef made():\n    pass\n")
    script = tmp_path / "bench.py"
    script.write_text(
        "from offload.engine.graphs import DecodeGraphs\n"
        "from offload.engine.row_graphs import RowGraphs\n"
        "from helper import VALUE, made, gone\n"
        "import offload.no_such_module\n"
    )
    assert _missing(script) == [
        "from offload.engine.graphs import DecodeGraphs",
        "from helper import gone",
        "import offload.no_such_module (No module named 'offload.no_such_module')",
    ]
