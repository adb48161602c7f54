"""The package layering holds: every import (also those inside functions) walked with ``ast``.

Every folder installs under one namespace (``serving/`` is ``shardserve.serving``, setup.py); the
names below are the folders' (``serving.engine`` is ``shardserve.serving.engine``), and the
namespace's root module (``shardserve/__init__.py``: the version) may be imported by any of them.

models <- partitioner <- {serving, training, loadtest} <- shardserve (the console script's home).
serving and training never import each other; models knows nothing of parallelism, serving or
training; no module takes part in an import circle. Inside the packages (the rooms of
``../shared/DESIGN.md``):

- ``partitioner/``'s top level (the partition itself) imports no process runtime;
- ``partitioner/runtime/`` (the gang, ranks, channel, remote join) imports no program: neither the
  forward stream (``partitioner/stream/``), serving nor training, not even by a name in a string;
- serving's front end reaches the fleet only through the engine and the model repository
  (``serving/fleet/repository.py``: the served models by name, each its engine); nothing in serving
  flows up (front end -> engine -> fleet: the fleet knows an engine only as its ``ModelEngine``
  protocol), and ``serving/config.py`` (the configs every room reads) and ``serving/errors.py`` (the
  error every room may end a call with) are leaves;
- ``argparse`` is used in the console script's home (``shardserve/``) only;
- no source file outside ``tests/`` and ``benchmarks/`` has more than 600 lines.
"""

from __future__ import annotations

import ast
import re
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


NAMESPACE = "shardserve"


def _module_name(path: Path) -> str:
    """The short (folder) name of a source file: ``serving/engine/core.py`` -> ``serving.engine.core``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _short(name: str) -> str:
    """An imported name in folder form: ``shardserve.serving.engine`` -> ``serving.engine``."""
    head, _, rest = name.partition(".")
    return rest if head == NAMESPACE and rest.split(".")[0] in PACKAGES[:-1] else name


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
        for name in map(_short, names):
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
        graph[name] = {
            m for m in _imports(path, modules) if m not in (name, NAMESPACE) and not name.startswith(m + ".")
        }
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


def _wrong_edges(
    graph: dict[str, set[str]], src_prefix: str, banned: tuple[str, ...], allowed: tuple[str, ...] = ()
) -> list[str]:
    inside = lambda name, prefix: name == prefix or name.startswith(prefix + ".")  # noqa: E731
    return sorted(
        f"{src} -> {dst}"
        for src, dsts in graph.items()
        if inside(src, src_prefix)
        for dst in dsts
        if any(inside(dst, b) for b in banned) and dst not in allowed
    )


def test_the_rooms_import_only_downwards() -> None:
    graph = import_graph()
    top = {m: d for m, d in graph.items() if m.count(".") == 1 and m.startswith("partitioner.")}
    rooms = ("serving.frontend", "serving.engine", "serving.fleet")
    rules = [
        (top, "partitioner", ("partitioner.runtime", "partitioner.stream"), ()),
        (
            graph,
            "partitioner.runtime",
            ("partitioner.stream", "serving", "training", "loadtest", "shardserve"),
            (),
        ),
        (graph, "serving.frontend", ("serving.fleet",), ("serving.fleet.repository",)),
        (graph, "serving.engine", ("serving.frontend",), ()),
        (graph, "serving.fleet", ("serving.frontend", "serving.engine"), ()),
        (graph, "serving.config", rooms, ()),  # a leaf
        (graph, "serving.errors", rooms, ()),  # a leaf
    ]
    wrong = [edge for g, src, banned, allowed in rules for edge in _wrong_edges(g, src, banned, allowed)]
    assert not wrong, "imports against the rooms' layering:\n" + "\n".join(wrong)


def test_the_runtime_names_no_program_in_a_string() -> None:
    """A dotted name in a string (``importlib``, a spec) is an import no graph sees."""
    found = []
    for path in (ROOT / "partitioner" / "runtime").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if re.search(r"\b(training|serving|partitioner\.stream)\.[a-z_]+", node.value):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value[:60]!r}")
    assert not found, "\n".join(found)


def _source_files() -> list[Path]:
    return [p for pkg in (*PACKAGES, "deploy") for p in (ROOT / pkg).rglob("*.py")]


def test_argparse_lives_in_the_console_script_only() -> None:
    users = sorted(
        str(p.relative_to(ROOT))
        for p in _source_files()
        if "argparse" in _imports_any(p) and p.relative_to(ROOT).parts[0] != "shardserve"
    )
    assert not users, f"argparse outside shardserve/: {users}"


def _imports_any(path: Path) -> set[str]:
    """Every module name ``path`` imports (project or not), top-level names."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_no_source_file_is_over_600_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n for p in _source_files() if (n := len(p.read_text().splitlines())) > 600
    }
    assert not long, f"over 600 lines: {long}"


def test_the_walk_sees_imports() -> None:
    """The checks above would pass on an empty graph: make sure the walk finds known edges."""
    graph = import_graph()
    assert "models.qa_windows" in graph["training.features"]
    assert "serving.frontend.cli" in graph["shardserve.cli"]
    assert "models.config" in graph["partitioner.plan"]
    assert "partitioner.runtime.gang" in graph["partitioner.stream.driver"]
    assert "partitioner.runtime.wire" in graph["training.messages"]
    assert "serving.fleet.repository" in graph["serving.frontend.rest.routes"]  # the front end's door to the fleet
    assert "serving.fleet.model_engine" in graph["serving.fleet.repository"]
    assert "argparse" in _imports_any(ROOT / "shardserve" / "flags.py")


def test_every_import_uses_the_namespace() -> None:
    """``import serving`` would find the folder only from the repository root, never once installed."""
    bare = sorted(
        f"{p.relative_to(ROOT)}: import {name}"
        for p in [*_source_files(), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
        for name in _imports_any(p)
        if name in PACKAGES[:-1]
    )
    assert not bare, "imports without the shardserve namespace:\n" + "\n".join(bare)
