"""The shape of ``ps/``: wings in one order, each entered through its door, no import cycle,
and the servicer going through ``Shard`` only. A file's size is a question for review, not
an assertion.

``ps/`` is grouped into wings (subpackages) by job. A wing may import the wings below it in
``WINGS`` and the foundation modules beside them, never one above. Code outside a wing (other
wings, ``client``, ``worker``, ``deploy``, benchmarks, examples) imports the wing's package,
its door, whose ``__all__`` names its surface, and never one of its modules; tests may reach
into a wing's modules to test them. Imports are read from the source (``ast``),
``TYPE_CHECKING`` blocks included: a cycle that only type annotations close is still two
modules that cannot be understood apart.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PS = ROOT / "ps"
WINGS = ("store", "table", "durability", "replication", "elastic", "shard", "service")
"""From the ground up: each wing builds on the ones before it."""
FOUNDATION = ("errors", "rwlock", "yielding")
"""Modules beside the wings that any wing may import; they import no wing."""


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def written(path: Path) -> set[str]:
    """The ``ps`` modules and packages ``path`` names in its imports, as written."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "ps")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "ps":
            found.add(node.module)
    return found


def imports(path: Path) -> set[str]:
    """``written``, and the modules of a wing taken from it by name (``from ps.table import
    optimizers``): what ``path`` needs loaded."""
    found = written(path)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in found:
            package = ROOT / Path(*node.module.split("."))
            found.update(f"{node.module}.{a.name}" for a in node.names if (package / f"{a.name}.py").exists())
    return found


def imported_names(path: Path) -> set[str]:
    return {
        a.name
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ImportFrom)
        for a in node.names
    }


def wing_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in WINGS else None


def ps_files() -> list[Path]:
    return sorted(PS.rglob("*.py"))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
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


def test_ps_holds_wings_and_foundations_only() -> None:
    loose = sorted(p.stem for p in PS.glob("*.py")) + sorted(
        p.name for p in PS.iterdir() if p.is_dir() and p.name != "__pycache__"
    )
    assert loose == sorted(["__init__", "__main__", *FOUNDATION]) + sorted(WINGS), (
        "a new module of ps/ belongs in the wing of its job (or a new wing, added to WINGS in its place)"
    )


def test_each_wing_imports_only_the_wings_below_it() -> None:
    wrong = []
    for path in ps_files():
        mine = wing_of(module_name(path))
        for target in imports(path):
            theirs = wing_of(target)
            if mine is None and module_name(path).removeprefix("ps.") in FOUNDATION and theirs is not None:
                wrong.append(f"{module_name(path)} (a foundation) imports {target}")
            elif mine is not None and theirs is not None and WINGS.index(theirs) > WINGS.index(mine):
                wrong.append(f"{module_name(path)} ({mine}) imports {target} ({theirs}, above it)")
    assert wrong == [], "\n".join(wrong)


def test_code_outside_a_wing_goes_through_its_door() -> None:
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    outside = [ROOT / f for f in tracked.stdout.split() if not f.startswith("tests/")]
    wrong = []
    for path in sorted({*outside, *ps_files()}):
        if not path.exists():
            continue
        mine = wing_of(module_name(path)) if path.is_relative_to(PS) else None
        for target in written(path):
            theirs = wing_of(target)
            if theirs is not None and theirs != mine and target != f"ps.{theirs}":
                wrong.append(f"{path.relative_to(ROOT)} imports {target}: import ps.{theirs} (its door)")
    assert wrong == [], "\n".join(wrong)


@pytest.mark.parametrize("wing", WINGS)
def test_a_wing_has_no_import_cycle_inside(wing: str) -> None:
    graph = {}
    for path in sorted((PS / wing).glob("*.py")):
        if path.stem != "__init__":
            graph[module_name(path)] = {t for t in imports(path) if wing_of(t) == wing and t != f"ps.{wing}"}
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def test_servicer_talks_to_the_shard_only() -> None:
    # The request path: decode, one Shard method, encode. The servicer never reaches
    # for a table or a private attribute of the shard.
    path = PS / "service" / "servicer.py"
    assert "Table" not in imported_names(path)
    tree = ast.parse(path.read_text())
    shard_calls = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "_shard"
    }
    allowed = {
        *("create_table", "specs", "index", "num_shards", "lookup", "push", "checkpoint", "follow", "serve_from"),
        *("get_map", "reshard_request", "move_rows", "load_checkpoint", "publish", "roll_back", "erase"),
    }
    assert shard_calls <= allowed, shard_calls
