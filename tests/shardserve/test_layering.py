"""The package layering holds: every import (also those inside functions) walked with ``ast``.

models <- partitioner <- {serving, training, loadtest} <- shardserve (the console script's home).
serving and training never import each other; models knows nothing of parallelism, serving or
training; no module takes part in an import circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("models", "partitioner", "serving", "training", "loadtest", "shardserve")
ALLOWED = {  # package -> the other packages it may import
    "models": set(),
    "partitioner": {"models"},
    "serving": {"models", "partitioner"},
    "training": {"models", "partitioner"},
    "loadtest": {"models", "partitioner"},
    "shardserve": {"models", "partitioner", "serving", "training", "loadtest"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Project modules ``path`` imports, anywhere in the file (resolved to the longest known module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    modules = set(files)
    graph = {}
    for name, path in files.items():
        # a package's __init__ is imported with each of its modules: not an edge of the module's own
        graph[name] = {m for m in _imports(path, modules) if m != name and not name.startswith(m + ".")}
    return graph


def test_packages_import_only_the_layers_below() -> None:
    graph = import_graph()
    wrong = sorted(
        f"{src} -> {dst}"
        for src, dsts in graph.items()
        for dst in dsts
        if dst.split(".")[0] != src.split(".")[0] and dst.split(".")[0] not in ALLOWED[src.split(".")[0]]
    )
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_no_import_circle() -> None:
    graph = import_graph()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    circles: list[str] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_walk_sees_imports() -> None:
    """The checks above would pass on an empty graph: make sure the walk finds known edges."""
    graph = import_graph()
    assert "models.qa_processing" in graph["training.squad_data"]
    assert "serving.frontend.cli" in graph["shardserve.cli"]
    assert "models.config" in graph["partitioner.plan"]
