"""Fixtures that run real shard processes on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.shards import RunningShard, start_shard, stop_shard


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[RunningShard]]:
    """Two shard processes; each must exit 0 on SIGTERM at teardown."""
    shards: list[RunningShard] = []
    try:
        for i in range(2):
            shards.append(start_shard(i, 2, tmp_path))
        yield shards
    finally:
        for s in shards:
            stop_shard(s)


@pytest.fixture
def addresses(cluster: list[RunningShard]) -> list[str]:
    return [s.address for s in cluster]


@pytest.fixture
def procs() -> Iterator[list[RunningShard]]:
    """Shard processes a test starts (it appends them); any still running at teardown (a
    failed test) are killed."""
    started: list[RunningShard] = []
    yield started
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()
