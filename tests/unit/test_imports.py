"""Package boundaries: what each package pulls into a fresh interpreter, and its ``__all__``.

The subprocesses open no sockets; they only import modules.
"""

from __future__ import annotations
import __future__

import ast
import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def top_level_modules_after(imports: str) -> set[str]:
    """Top-level names in ``sys.modules`` after ``import <imports>`` in a fresh interpreter."""
    code = (
        f"import sys, json\nimport {imports}\nprint(json.dumps(sorted({{name.split('.')[0] for name in sys.modules}})))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"import {imports} failed:\n{proc.stderr[-3000:]}"
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize(
    "imports, expected, forbidden",
    [
        ("client", {"client", "protos", "numpy", "grpc"}, {"torch", "ps", "worker"}),
        # A Predict caller needs neither torch nor the model's code.
        ("client.predict", {"client", "protos", "grpc"}, {"torch", "ps", "worker"}),
        ("ps, ps.service", {"ps", "protos", "numpy", "grpc"}, {"client", "torch", "worker"}),
        ("protos", {"protos", "numpy", "grpc", "google"}, {"ps", "client", "worker", "torch", "numba"}),
        ("protos.hashing", {"protos", "numba"}, {"ps", "client", "worker", "torch"}),
        ("worker", {"worker", "client", "protos", "torch"}, {"ps", "deploy"}),
        ("deploy", {"deploy"}, {"torch", "worker", "ps"}),
    ],
)
def test_package_boundaries(imports: str, expected: set[str], forbidden: set[str]) -> None:
    loaded = top_level_modules_after(imports)
    assert expected <= loaded, f"import {imports} did not load {expected - loaded}"
    assert not loaded & forbidden, f"import {imports} loaded {sorted(loaded & forbidden)}"


def defined_public_names(pkg: ModuleType) -> set[str]:
    """Public names a package defines or re-exports: not submodules, not ``from __future__`` flags."""
    return {
        name
        for name, value in vars(pkg).items()
        if not name.startswith("_") and not inspect.ismodule(value) and not isinstance(value, __future__._Feature)
    }


# Which of our packages each package's modules may import (DESIGN.md, "Parts and what each owns"),
# and third-party packages they must not.
OURS = {"protos", "ps", "client", "worker", "deploy", "tests"}
ALLOWED: dict[str, tuple[set[str], set[str]]] = {
    "protos": (set(), {"torch"}),  # numba only in protos.hashing, checked above
    "ps": ({"protos"}, {"torch"}),
    "client": ({"protos"}, {"torch"}),
    "worker": ({"client", "protos"}, set()),
    "deploy": ({"protos", "ps", "client", "worker"}, set()),
}


def imported_top_levels(path: Path) -> set[str]:
    """Top-level names a module imports anywhere in its body (absolute imports only)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_every_module_imports_only_what_its_package_may(package: str) -> None:
    ours, banned = ALLOWED[package]
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package}/ has no modules"
    bad = []
    for path in files:
        names = imported_top_levels(path)
        wrong = (names & OURS) - ours - {package} | (names & banned)
        if wrong:
            bad.append(f"{path.relative_to(ROOT)} imports {sorted(wrong)}")
    assert bad == [], "\n".join(bad)


@pytest.mark.parametrize(
    "name",
    ["protos", "protos.rpc", "client", "ps", "worker", "deploy"]
    + [f"ps.{wing}" for wing in ("store", "table", "durability", "replication", "elastic", "shard", "service")],
)
def test_dunder_all_matches_exports(name: str) -> None:
    pkg = importlib.import_module(name)
    exported = pkg.__all__
    assert exported, f"{name}.__all__ is empty"
    assert list(exported) == sorted(set(exported)), f"{name}.__all__ is not sorted and unique"
    missing = [n for n in exported if not hasattr(pkg, n)]
    assert missing == [], f"{name}.__all__ lists names the package does not have"
    unlisted = sorted(defined_public_names(pkg) - set(exported))
    assert unlisted == [], f"{name} exports names missing from __all__"
