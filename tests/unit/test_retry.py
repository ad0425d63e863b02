"""Retries of the client: until the deadline, capped jittered backoff, CANCELLED, errors that
name their shard, undecodable replies. Real ``Shard``s behind ``InProcessTransport``."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest

from client import ClientConfig, InternalServerError, InvalidRequestError, PSClient, ShardUnavailableError
from client.errors import OVERLOADED, error_for
from client.retry import backoff_s
from ps.shard import Shard
from tests.fakes import InProcessTransport
from tests.unit.test_client import DIM, FAST, KEYS, N, addresses


@pytest.fixture
def shards() -> list[Shard]:
    return [Shard(i, N) for i in range(N)]


@pytest.fixture
def transport(shards: list[Shard]) -> InProcessTransport:
    return InProcessTransport(shards)


def test_retries_go_on_until_the_deadline_not_an_attempt_count(
    shards: list[Shard], transport: InProcessTransport
) -> None:
    # A shard restart fails calls for seconds: dozens of attempts, then success.
    with PSClient(addresses(), FAST, transport=transport) as ps:
        ps.create_table("t", DIM)
        transport.fail_next("Push", grpc.StatusCode.UNAVAILABLE, times=40, shard=1)
        result = ps.push("t", KEYS, np.ones((len(KEYS), DIM), np.float32))
    assert result.rows_updated == len(KEYS) and result.duplicates == 0
    assert transport.count("Push", 1) == 41
    pushes = sum(int(s.table("t").counters.pushes > 0) for s in shards)
    assert pushes == N  # every shard applied its part exactly once


def test_cancelled_by_a_stopping_shard_is_retried_like_unavailable(
    shards: list[Shard], transport: InProcessTransport
) -> None:
    with PSClient(addresses(), FAST, transport=transport) as ps:
        ps.create_table("t", DIM)
        transport.fail_next("Push", grpc.StatusCode.CANCELLED, times=2, after_apply=True, shard=0)
        result = ps.push("t", KEYS, np.ones((len(KEYS), DIM), np.float32))
    assert result.duplicates == 1  # the first attempt was applied; its resends were recognised
    assert error_for(grpc.StatusCode.CANCELLED) is ShardUnavailableError


def test_a_refusal_for_load_is_retried_and_uses_up_no_attempt(
    shards: list[Shard], transport: InProcessTransport
) -> None:
    # A call that must not be sent twice (max_attempts=1: a publication, a checkpoint) still
    # waits out a busy shard: it refused before doing anything. Anything else ends it.
    once = dataclasses.replace(FAST, max_attempts=1)
    with PSClient(addresses(), once, transport=transport) as ps:
        ps.create_table("t", DIM)
        transport.fail_next("Push", grpc.StatusCode.RESOURCE_EXHAUSTED, times=3, shard=1, trailing=(OVERLOADED,))
        result = ps.push("t", KEYS, np.ones((len(KEYS), DIM), np.float32))
        assert result.duplicates == 0 and transport.count("Push", 1) == 4
        assert ps.admin.refusals() == 3 and [h["refused"] for h in ps.admin.replica_health()][1] == 3
        transport.fail_next("Push", grpc.StatusCode.UNAVAILABLE, times=1, shard=1)
        with pytest.raises(ShardUnavailableError, match="gave up after 1 attempts"):
            ps.push("t", KEYS, np.ones((len(KEYS), DIM), np.float32))


def test_deadline_ends_retries_with_the_failing_shards_error(
    shards: list[Shard], transport: InProcessTransport
) -> None:
    config = ClientConfig(deadline_s=0.3, backoff_initial_s=0.01, backoff_max_s=0.02, tune_malloc=False)
    with PSClient(addresses(), config, transport=transport) as ps:
        ps.create_table("t", DIM)
        transport.fail_next("Lookup", grpc.StatusCode.UNAVAILABLE, times=10_000, shard=2)
        started = time.monotonic()
        with pytest.raises(ShardUnavailableError, match=r"deadline_s=0.3 passed") as info:
            ps.lookup("t", KEYS)
    assert 0.25 < time.monotonic() - started < 2.0
    assert info.value.shard == 2 and "shard 2 (inproc:2)" in str(info.value)
    assert transport.count("Lookup", 2) > 5


def test_backoff_is_capped_and_jittered() -> None:
    config = ClientConfig(backoff_initial_s=0.05, backoff_max_s=1.0)
    pauses = [backoff_s(attempt, config) for attempt in range(200) for _ in range(5)]
    assert max(pauses) <= 1.0 and min(pauses) >= 0.0
    assert len(set(pauses)) > 900  # jittered, not a fixed schedule
    assert max(backoff_s(0, config) for _ in range(100)) <= 0.05


def test_too_large_row_is_an_invalid_request_naming_the_setting(
    shards: list[Shard], transport: InProcessTransport
) -> None:
    config = ClientConfig(max_message_bytes=1 << 16, tune_malloc=False)
    with PSClient(addresses(), config, transport=transport) as ps:
        ps.create_table("wide", 20_000)
        with pytest.raises(InvalidRequestError, match="max_message_bytes") as info:
            ps.lookup("wide", [1])
    assert isinstance(info.value, ValueError)


def test_undecodable_reply_is_an_internal_error_naming_the_shard(
    shards: list[Shard], transport: InProcessTransport
) -> None:
    with PSClient(addresses(), FAST, transport=transport) as ps:
        ps.create_table("t", DIM)
        real = transport.call

        def garbled(shard: int, method: str, request: bytes, timeout_s: float) -> object:
            call = real(shard, method, request, timeout_s)
            return _Garbled() if method == "Lookup" and shard == 1 else call

        transport.call = garbled  # type: ignore[method-assign]
        with pytest.raises(InternalServerError, match=r"shard 1 \(inproc:1\): Lookup reply does not decode"):
            ps.lookup("t", KEYS)


class _Garbled:
    def result(self, timeout_s: float | None = None) -> bytes:
        return b"\xff\xff\xff"

    def cancel(self) -> bool:
        return False


class _Later:
    """A call that finishes ``delay_s`` after it starts, like a gRPC future."""

    def __init__(self, done: object, delay_s: float) -> None:
        self._done, self._event = done, threading.Event()
        self._callbacks: list[Callable[[Any], None]] = []
        self._lock = threading.Lock()
        threading.Timer(delay_s, self._finish).start()

    def _finish(self) -> None:
        with self._lock:
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    def result(self, timeout_s: float | None = None) -> bytes:
        if not self._event.wait(timeout_s):
            raise TimeoutError
        return self._done.result()  # type: ignore[attr-defined,no-any-return]

    def cancel(self) -> bool:
        return False

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)


def test_a_slow_shard_does_not_hold_up_the_retry_of_a_failing_one(
    shards: list[Shard], transport: InProcessTransport
) -> None:
    # The caller first waits for each shard's answer in turn, without callbacks; a failure
    # elsewhere must still be retried while a slow shard is answering, not after it.
    with PSClient(addresses(), FAST, transport=transport) as ps:
        ps.create_table("t", DIM)
        expected = ps.lookup("t", KEYS)
        real = transport.call
        sent: list[tuple[int, float]] = []
        started = time.monotonic()

        def slow_and_failing(shard: int, method: str, request: bytes, timeout_s: float) -> object:
            call = real(shard, method, request, timeout_s)
            sent.append((shard, time.monotonic() - started))
            return _Later(call, 0.8 if shard == 0 else 0.0)

        transport.call = slow_and_failing  # type: ignore[method-assign]
        transport.fail_next("Lookup", grpc.StatusCode.UNAVAILABLE, times=1, shard=1)
        rows = ps.lookup("t", KEYS)
    assert np.array_equal(rows, expected)
    assert [s for s, _ in sent].count(1) == 2  # the failed attempt and its retry
    retry_at = max(t for s, t in sent if s == 1)
    assert retry_at < 0.5, f"shard 1 retried {retry_at:.2f} s in, after slow shard 0 answered (0.8 s)"
    assert time.monotonic() - started >= 0.8
