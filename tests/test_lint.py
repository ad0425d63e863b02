"""The code is linted, formatted and typed: ruff check, ruff format --check and mypy --strict.

These run the tools the developers run (settings in pyproject.toml), so a red CI shows the
same findings as a developer's terminal. mypy covers the packages STYLE.md names strict.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TYPED = ["ps", "client", "deploy", "worker", "protos/wire.py", "protos/keys.py", "protos/rpc"]


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def _ruff() -> str:
    found = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: pip install -c constraints.txt -e '.[dev]'")
    return found


def test_ruff_check() -> None:
    result = _run(_ruff(), "check", ".")
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


def test_ruff_format() -> None:
    result = _run(_ruff(), "format", "--check", ".")
    assert result.returncode == 0, f"run `ruff format .`:\n{result.stdout[-5000:]}{result.stderr[-2000:]}"


def test_mypy_strict() -> None:
    result = _run(sys.executable, "-m", "mypy", "--strict", *TYPED)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
