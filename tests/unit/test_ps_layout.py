"""The shape of ``ps/``: no import cycles between its modules, and the servicer going
through ``Shard`` only. A file's size is a question for review, not an assertion.

Imports are read from the source (``ast``), ``TYPE_CHECKING`` blocks included: a cycle
that only type annotations close is still two modules that cannot be understood apart.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PS = ROOT / "ps"
MODULES = sorted(f"ps.{p.stem}" for p in PS.glob("*.py") if p.stem != "__init__")


def ps_imports(module: str) -> set[str]:
    """The ``ps.*`` modules ``module`` imports anywhere in its body."""
    path = PS / f"{module.split('.')[1]}.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ps."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("ps."):
                found.add(node.module)
            elif node.module == "ps":  # from ps import optimizers
                found.update(f"ps.{a.name}" for a in node.names if f"ps.{a.name}" in MODULES)
    return found & set(MODULES)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_ps_modules_import_no_cycle() -> None:
    graph = {m: ps_imports(m) for m in MODULES}
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"


def test_servicer_talks_to_the_shard_only() -> None:
    # The request path: decode, one Shard method, encode. The servicer never reaches
    # for a table or a private attribute of the shard.
    tree = ast.parse((PS / "servicer.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "ps.table" not in imported
    shard_calls = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "_shard"
    }
    allowed = {
        *("create_table", "specs", "index", "num_shards", "lookup", "push", "checkpoint", "follow", "serve_from"),
        *("get_map", "reshard_request", "move_rows"),
    }
    assert shard_calls <= allowed, shard_calls
