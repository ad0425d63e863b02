"""Unit tests touch no network: connecting a socket fails the test. The PSClient tests' cluster
(``shards``, ``transport``, ``ps``: see ``tests.unit.client_cluster``) is built here."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from client import PSClient
from ps.shard import Shard
from tests.fakes import InProcessTransport
from tests.unit.client_cluster import DIM, FAST, N, addresses


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("unit tests must not open network connections; move this test to tests/integration")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


@pytest.fixture
def shards() -> list[Shard]:
    return [Shard(i, N) for i in range(N)]


@pytest.fixture
def transport(shards: list[Shard]) -> InProcessTransport:
    return InProcessTransport(shards)


@pytest.fixture
def ps(transport: InProcessTransport) -> Iterator[PSClient]:
    with PSClient(addresses(), FAST, transport=transport) as client:
        client.create_table("t", DIM, lr=0.5, seed=3)
        yield client
