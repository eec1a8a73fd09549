"""No module imports one of a higher layer: the packages follow the data path, lowest first.

Every import counts, including those inside functions (a lazy import that goes upward is
the same dependency, only hidden), so the layers stay readable from the bottom up.
"""

import ast
from pathlib import Path

import pytest

import offload

SRC = Path(offload.__file__).parent

# Lowest first; a module is in the layer of the longest prefix that names it. Modules of
# one layer may import each other.
LAYERS = (
    ("offload.errors", "offload.sizes"),
    ("offload.memory",),
    ("offload.config",),
    ("offload.offloader",),
    ("offload.api",),
    ("offload.quant",),
    ("offload.model",),
    ("offload.engine",),
    ("offload.planner",),
    ("offload.probes",),
    ("offload.distributed",),
    ("offload.llm",),
    ("offload.server",),
    ("offload.bench",),
    ("offload.cli",),
    ("offload",),
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(SRC.rglob("*.py"))}


def layer_of(module: str) -> int:
    matches = [
        (len(prefix), index)
        for index, prefixes in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    if not matches:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return max(matches)[1]


def imported_modules(module: str, source: str) -> set[str]:
    """The `offload` modules that `source` (of `module`) imports, anywhere in it; `from
    package import name` counts as the submodule `package.name` where there is one."""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in MODULES else base)
    return {name for name in found if name == "offload" or name.startswith("offload.")}


def upward_imports(module: str, source: str) -> list[str]:
    own = layer_of(module)
    return sorted(name for name in imported_modules(module, source) if layer_of(name) > own)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_a_higher_layer(module):
    assert upward_imports(module, MODULES[module].read_text()) == []


UNDER_MODEL, UNDER_PLANNER = ["offload", "model"], ["offload", "planner"]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("offload.engine")))
def test_the_engine_imports_neither_model_nor_planner(module):
    """The engine runs a built model: block formats and their products from `quant/`, never
    how a model is loaded (`model/`) or chosen (`planner/`), though both are below it."""
    found = imported_modules(module, MODULES[module].read_text())
    assert sorted(n for n in found if n.split(".")[:2] in (UNDER_MODEL, UNDER_PLANNER)) == []


def test_the_check_sees_imports_inside_functions():
    source = "def late():\n    from offload.llm.llm import LLM\n    from .. import api\n"
    assert upward_imports("offload.memory.host", source) == ["offload.api", "offload.llm.llm"]
    assert upward_imports("offload.config.flags", source) == ["offload.api", "offload.llm.llm"]
    assert upward_imports("offload.cli.main", source) == []


# The planner decides and builds nothing: it reaches, directly or through the modules it
# imports, neither `offload.api` (whose dry run builds an offloader), nor an offloader
# (base, backends, factory, hooks), nor the engine. Of `offload.offloader` it may use the
# pure functions of layer stacks, names, indices and sizes, and (through the quantized
# layouts it reads a model's stored form with) the registry of custom ops.
BUILDERS = ("offload.api", "offload.engine", "offload.offloader")
NOT_BUILDERS = (
    "offload.offloader.layers",
    "offload.offloader.selection",
    "offload.offloader.disk_placement",
    "offload.offloader.ops",
)


def reached(module: str) -> set[str]:
    """The modules `module` imports, directly or through others (a package's `__init__`
    where it is imported itself, not for each of its submodules)."""
    seen, pending = {module}, [module]
    while pending:
        current = pending.pop()
        for name in imported_modules(current, MODULES[current].read_text()):
            if name in MODULES and name not in seen:
                seen.add(name)
                pending.append(name)
    return seen - {module}


def is_builder(module: str) -> bool:
    return module not in NOT_BUILDERS and any(
        module == prefix or module.startswith(prefix + ".") for prefix in BUILDERS
    )


@pytest.mark.parametrize("module", [m for m in sorted(MODULES) if m.startswith("offload.planner")])
def test_the_planner_builds_nothing(module):
    assert sorted(name for name in reached(module) if is_builder(name)) == []


def test_the_builder_check_sees_a_module_reached_through_another():
    assert is_builder("offload.offloader.factory") and is_builder("offload.api")
    assert not is_builder("offload.offloader.selection") and not is_builder("offload.planner")
    assert "offload.offloader.factory" in reached("offload.llm.fit")  # (through offload.api)


def test_no_two_packages_share_a_layer():
    shared = [layer for layer in LAYERS[1:] if len(layer) > 1]
    assert shared == []


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for child in sorted(graph.get(node, ())):
            if child not in index:
                visit(child)
                low[node] = min(low[node], low[child])
            elif child in stack:
                low[node] = min(low[node], index[child])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_import_circle():
    """Not even through a package's `__init__` or an import inside a function."""
    graph = {
        module: imported_modules(module, path.read_text()) - {module}
        for module, path in MODULES.items()
    }
    assert import_cycles(graph) == []


def test_the_cycle_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]


MAX_LINES = 375  # a module past this is split by what it does (docs/design.md)


def test_no_module_is_longer_than_the_limit():
    long = {
        str(path.relative_to(SRC)): count
        for path in SRC.rglob("*.py")
        if (count := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}
