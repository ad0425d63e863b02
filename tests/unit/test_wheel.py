"""The wheel ``pip install .`` builds (the container image's install) holds every package of the tree."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOTS = ("protos", "ps", "client", "worker", "deploy")


def test_wheel_holds_every_package_and_the_protos(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {str(p.relative_to(ROOT)) for r in ROOTS for p in (ROOT / r).rglob("__init__.py")}
    assert packages and "ps/table/__init__.py" in packages
    assert packages - names == set(), "packages left out of the wheel"
    modules = {str(p.relative_to(ROOT)) for pkg in packages for p in (ROOT / pkg).parent.glob("*.py")}
    assert modules - names == set()
    assert {"protos/ps.proto", "protos/infer.proto"} <= names
