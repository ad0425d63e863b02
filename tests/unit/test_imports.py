"""Package boundaries: what each package pulls into a fresh interpreter, and its ``__all__``.

The subprocesses open no sockets; they only import modules.
"""

from __future__ import annotations

import __future__

import importlib
import importlib.util
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
        f"import sys, json\nimport {imports}\n"
        "print(json.dumps(sorted({name.split('.')[0] for name in sys.modules})))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"import {imports} failed:\n{proc.stderr[-3000:]}"
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize(
    "imports, expected, forbidden",
    [
        ("client", {"client", "protos", "numpy", "grpc"}, {"torch", "ps", "worker"}),
        ("ps, ps.server, ps.servicer", {"ps", "protos", "numpy", "grpc"}, {"client", "torch", "worker"}),
        ("protos", {"protos", "numpy", "grpc", "google"}, {"ps", "client", "worker", "torch", "numba"}),
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
        if not name.startswith("_")
        and not inspect.ismodule(value)
        and not isinstance(value, __future__._Feature)
    }


@pytest.mark.parametrize("name", ["protos", "client", "ps", "worker"])
def test_dunder_all_matches_exports(name: str) -> None:
    if name in ("ps", "worker"):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"package {name} does not exist yet")
        if not hasattr(importlib.import_module(name), "__all__"):
            pytest.skip(f"{name}/__init__.py does not define __all__ yet")
    pkg = importlib.import_module(name)
    exported = pkg.__all__
    assert exported, f"{name}.__all__ is empty"
    assert list(exported) == sorted(set(exported)), f"{name}.__all__ is not sorted and unique"
    missing = [n for n in exported if not hasattr(pkg, n)]
    assert missing == [], f"{name}.__all__ lists names the package does not have"
    unlisted = sorted(defined_public_names(pkg) - set(exported))
    assert unlisted == [], f"{name} exports names missing from __all__"
