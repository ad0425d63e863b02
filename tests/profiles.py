"""Which profile a run asked for: slow soak/fault tests run short in a plain run, long under ``-m slow``."""

from __future__ import annotations

import re

import pytest

__all__ = ["long_run"]


def long_run(config: pytest.Config) -> bool:
    """True when this run selected slow tests (``pytest -m slow``)."""
    expr = config.getoption("markexpr", "") or ""
    return re.search(r"(?<!not )\bslow\b", expr) is not None
