"""Import rules of both packages, read from the source with ast (nothing is imported).

* No import circle in either package, counting every import: top level, inside
  functions and under ``if TYPE_CHECKING:`` (readers and type checkers see those).
* The sidecar imports only public ``saga_otel`` modules (no ``saga_otel._x``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("saga_otel", "sidecar")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(package: str) -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``name`` imports, anywhere in its source."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                # "from . import x" in a package's __init__ is relative to the package itself.
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            for alias in node.names:
                # "from pkg import mod" imports the module pkg.mod; otherwise a name of pkg.
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in known else target)
    return {m for m in out if m in known and m != name}


def _graph(package: str) -> dict[str, set[str]]:
    modules = _modules(package)
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_circle_and_only_a_circle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_graph_sees_type_checking_and_function_level_imports(tmp_path: Path) -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ._b import B\n"
        "def f():\n    from . import _c\n"
    )
    path = tmp_path / "_x.py"  # the name, not the place, puts it in the package
    path.write_text(source)
    known = {"sidecar._b", "sidecar._c", "sidecar._x"}
    assert _imports("sidecar._x", path, known) == {"sidecar._b", "sidecar._c"}


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle(package: str) -> None:
    graph = _graph(package)
    assert len(graph) > 5, graph  # the walk found the package
    cycle = _cycle(graph)
    assert cycle is None, (
        f"import circle in {package}: {' -> '.join(cycle)}; move what both sides need "
        "into a leaf module (a protocol or the shared types) that imports neither"
    )


def test_the_sidecar_imports_only_public_saga_otel_modules() -> None:
    bad = []
    for name, path in _modules("sidecar").items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for target in targets:
                parts = target.split(".")
                if parts[0] == "saga_otel" and any(p.startswith("_") for p in parts[1:]):
                    bad.append(f"{name}: {target}")
    assert not bad, (
        f"the sidecar imports private saga_otel names: {bad}; use the public modules "
        "(saga_otel, saga_otel.semconv, saga_otel.records, saga_otel.contract, "
        "saga_otel.testing) or make what it needs public"
    )
