"""The packages import one way (DESIGN.md, the architecture issue): a module imports only from its
own package or from packages before it in the order

    graph, options -> cost -> schedule -> fusion -> codegen -> runtime -> pipeline, the planning
    worker's main (worker.py) -> the backend entry point (backend.py) -> the package's __init__
    -> bench, cli, fuzz

``frontend`` imports only ``graph`` and ``options``, and only ``pipeline`` and what stands above
it import ``frontend``. Every import counts, at the top of a
module or inside a function (or under ``if TYPE_CHECKING:``). No two modules import each other,
directly or around a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent / "fusionstitching"
RANK = {"graph": 0, "options": 0, "_host": 0, "cost": 1, "schedule": 2, "fusion": 3, "codegen": 4, "runtime": 5,
        "pipeline": 6, "worker": 6, "backend": 7, "__init__": 8, "bench": 9, "cli": 9, "fuzz": 9}

def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str:
    parts = module.split(".")[1:]
    if not parts:
        return "__init__"
    return parts[0]


def imports() -> dict[str, set[str]]:
    """Module -> the package modules it imports (``from m import name`` counts ``m`` and, where
    ``m.name`` is a module, that too)."""
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    result: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.add(node.module)
                targets.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules)
        result[module] = {t for t in targets if t in modules and t != module}
    return result


def _allowed(importer: str, imported: str) -> bool:
    mine, theirs = _unit(importer), _unit(imported)
    if mine == theirs:
        return True
    if mine == "frontend":
        return theirs in ("graph", "options")
    if theirs == "frontend":
        return RANK[mine] >= RANK["pipeline"]
    return RANK[theirs] <= RANK[mine]


def violations() -> set[tuple[str, str]]:
    return {(a, b) for a, targets in imports().items() for b in targets
            if not _allowed(a, b) and not b.endswith("__init__") and b != "fusionstitching"}


def cycles() -> set[frozenset[str]]:
    """Modules that import each other, directly or around a cycle (imports for annotations under
    ``if TYPE_CHECKING:`` included: two modules that name each other's types are one concept)."""
    graph = nx.DiGraph()
    for a, targets in imports().items():
        # a package's __init__ re-exports its modules: importing the package is not a cycle
        graph.add_edges_from((a, b) for b in targets if not (ROOT.parent / b.replace(".", "/")).is_dir())
    return {frozenset(c) for c in nx.strongly_connected_components(graph) if len(c) > 1}


def test_no_import_goes_against_the_layers():
    found = violations()
    assert not found, f"imports against the layers: {sorted(found)}"


def test_no_file_level_import_cycle():
    found = cycles()
    assert not found, f"import cycles: {[sorted(c) for c in found]}"


def test_the_checker_sees_an_import_inside_a_function_and_against_the_order():
    assert not _allowed("fusionstitching.schedule.grouping", "fusionstitching.codegen.lower")
    assert not _allowed("fusionstitching.runtime.program", "fusionstitching.frontend.context")
    assert not _allowed("fusionstitching.frontend.torch_fx", "fusionstitching.runtime.executor")
    assert _allowed("fusionstitching.backend", "fusionstitching.pipeline")
    assert _allowed("fusionstitching.codegen.lower", "fusionstitching.graph.ops")
    assert "fusionstitching.codegen.generate" in imports()["fusionstitching"]  # inside a function
