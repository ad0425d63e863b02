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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``@pytest.mark.gpu`` tests where torch sees no CUDA device."""
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_tests:
        return
    import torch

    if not torch.cuda.is_available():
        for item in gpu_tests:
            item.add_marker(pytest.mark.skip(reason="needs CUDA: torch sees no CUDA device"))
