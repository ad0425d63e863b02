"""Shared fixtures: every test runs without the caller's PS_* settings."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Drop PS_* variables so a developer's shell cannot change what a test sees."""
    for name in list(os.environ):
        if name.startswith("PS_"):
            monkeypatch.delenv(name)
    yield
