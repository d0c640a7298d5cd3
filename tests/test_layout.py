"""The house rules of the package, checked on its source: small modules, no private names
across modules, no import cycles (``TYPE_CHECKING`` and function-local imports included)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dlstore"
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path) -> list[tuple[str, str]]:
    """(module, name) for every `from dlstore... import name` in the file, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("dlstore"):
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if alias.name.startswith("dlstore")]
    return found


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        targets = set()
        for module, imported in imports_of(path):
            submodule = f"{module}.{imported}"
            targets.add(submodule if submodule in MODULES else module)
        graph[name] = {t for t in targets if t in MODULES and t != name}
    return graph


def test_no_module_is_longer_than_the_limit():
    long = {name: n for name, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_no_module_imports_another_modules_private_names():
    private = [
        f"{name} imports {imported} from {module}"
        for name, path in MODULES.items()
        for module, imported in imports_of(path)
        if imported.startswith("_") and not imported.startswith("__") and f"{module}.{imported}" not in MODULES
    ]
    assert private == []


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    cycles = []

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in state:
                walk(target, path + [target])
        state[node] = 2

    for node in graph:
        if node not in state:
            walk(node, [node])
    assert cycles == []


def test_the_cycle_check_sees_a_cycle(monkeypatch):
    """The check must be able to fail: a two-module cycle is reported."""
    monkeypatch.setattr(sys.modules[__name__], "import_graph", lambda: {"a": {"b"}, "b": {"a"}})
    with pytest.raises(AssertionError, match="a -> b -> a"):
        test_the_import_graph_has_no_cycle()
