"""Background loops of a shard: a failing loop shows in ``LoopHealth``, ``Stats`` and its
listeners (the server's ``Background`` health service) until a run of it succeeds.

The failures are real: the data directory's RocksDB is reopened read-only in place and
a second handle holds its lock (see ``test_rescue``), so the shard's TTL sweep cannot
delete and its storage recovery cannot reopen, until the test lets go.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from ps.durability import Durability
from ps.service.report import shard_stats
from ps.shard import Shard
from ps.shard.background import EVICTOR, STORAGE_RECOVERY, TTL_SWEEP, LoopHealth, RateWindow
from ps.store import Storage, StorageFailed
from ps.table import Lifecycle, TableSpec
from tests.unit.test_rescue import Blocker, refuse_writes

KEYS = np.arange(50, dtype=np.int64)


def wait_for(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# -- LoopHealth and RateWindow ------------------------------------------------------------


def test_a_loop_fails_in_a_row_and_clears_on_success(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ps.shard.background")
    health = LoopHealth()
    heard: list[bool] = []
    health.on_change(heard.append)
    for _ in range(3):
        with health.run(EVICTOR):
            raise StorageFailed("disk full")
    with health.run(TTL_SWEEP):
        raise KeyError("bug")
    (evictor, ttl) = health.failing()
    assert (evictor.loop, evictor.error, evictor.failures) == (EVICTOR, "disk full", 3)
    assert evictor.first_failure_unix_s <= evictor.last_failure_unix_s and ttl.error == "KeyError: 'bug'"
    assert heard == [False] and not health.healthy
    # Logged once per loop when it starts failing; the unexpected error with its traceback.
    failing = [r for r in caplog.records if "failing" in r.getMessage()]
    assert [r.exc_info is not None for r in failing] == [False, True]

    with health.run(EVICTOR):
        pass
    assert [f.loop for f in health.failing()] == [TTL_SWEEP] and heard == [False]
    health.succeeded(TTL_SWEEP)
    assert health.healthy and health.failing() == [] and heard == [False, True]
    assert "background loop evictor recovered after 3 failed runs" in caplog.text
    assert "background loop ttl-sweep recovered after 1 failed runs" in caplog.text


def test_listeners_end_on_the_state_when_loops_fail_and_recover_at_once() -> None:
    health = LoopHealth()
    heard: list[bool] = []
    health.on_change(heard.append)

    def flap(loop: str) -> None:
        for _ in range(2000):
            health.failed(loop, StorageFailed("disk full"))
            health.succeeded(loop)

    threads = [threading.Thread(target=flap, args=(loop,)) for loop in (EVICTOR, TTL_SWEEP, STORAGE_RECOVERY)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    health.failed(EVICTOR, StorageFailed("disk full"))
    assert heard[-1] is False and not health.healthy
    # Alternating, starting from a failure: never two of the same in a row.
    assert heard[0] is False and all(a != b for a, b in zip(heard, heard[1:]))
    health.succeeded(EVICTOR)
    assert heard[-1] is True


def test_rates_are_per_second_over_the_window() -> None:
    rates = RateWindow(window_s=10.0)
    assert rates.rates("t", 2) == (0.0, 0.0)
    rates.sample(100.0, {"t": (0, 0)})
    rates.sample(102.0, {"t": (10, 4)})
    assert rates.rates("t", 2) == (5.0, 2.0) and rates.rates("other", 2) == (0.0, 0.0)
    rates.sample(120.0, {"t": (10, 4)})  # the old samples leave the window
    rates.sample(121.0, {"t": (13, 4)})
    assert rates.rates("t", 2) == (3.0, 0.0)


# -- a shard's loops failing for real -------------------------------------------------------


@pytest.fixture
def shard(tmp_path: Path) -> Iterator[Shard]:
    s = Shard(0, 1, Storage(tmp_path / "data", shard=0, num_shards=1), Durability.parse("checkpoint-only"))
    yield s
    if s.storage is not None and s.storage._db is not None:
        s.shutdown()


def test_a_failing_ttl_sweep_shows_in_stats_and_health_until_it_recovers(shard: Shard, tmp_path: Path) -> None:
    shard.create_table(TableSpec("t", 4, lifecycle=Lifecycle(ttl_seconds=0.5)))
    shard.table("t").lookup(KEYS)
    shard.flush()
    heard: list[bool] = []
    shard.health.on_change(heard.append)
    refuse_writes(shard.storage)  # type: ignore[arg-type]
    blocker = Blocker(tmp_path / "data")
    try:
        shard.start()  # the sweep runs every 0.5 s: the rows expire and cannot be deleted
        wait_for(lambda: {f.loop for f in shard.health.failing()} == {TTL_SWEEP, STORAGE_RECOVERY})
        assert heard == [False] and not shard.writable
        stats = shard_stats(shard)
        failing = {f.loop: f for f in stats.failing_loops}
        assert "storage write failed" in failing[TTL_SWEEP].error and failing[TTL_SWEEP].failures == 1
        assert failing[STORAGE_RECOVERY].failures >= 1 and failing[STORAGE_RECOVERY].last_failure_unix_s > 0
        assert len(shard.table("t")) == len(KEYS)  # nothing was deleted in RAM either
    finally:
        blocker.release()
    # Storage recovers; the sweep runs at once, deletes the rows and clears its record.
    wait_for(lambda: heard == [False, True])  # heard just after `healthy` turns
    assert shard.health.healthy and shard.writable and list(shard_stats(shard).failing_loops) == []
    assert len(shard.table("t")) == 0 and shard.table("t").counters.rows_expired == len(KEYS)


def test_a_failing_evictor_shows_in_health(tmp_path: Path) -> None:
    probe = Shard(0, 1)
    probe.create_table(TableSpec("t", 4))
    per_row = probe.table("t").bytes_per_row
    shard = Shard(
        0,
        1,
        Storage(tmp_path / "data", shard=0, num_shards=1),
        Durability.parse("checkpoint-only"),
        memory_budget_bytes=100 * per_row,
    )
    try:
        shard.create_table(TableSpec("t", 4))
        shard.table("t").lookup(np.arange(98))  # above the evictor's high water, within the budget
        refuse_writes(shard.storage)  # type: ignore[arg-type]
        blocker = Blocker(tmp_path / "data")
        try:
            shard.start()
            wait_for(lambda: EVICTOR in {f.loop for f in shard.health.failing()})
            assert not shard.writable and len(shard.table("t")) == 98  # nothing left RAM
        finally:
            blocker.release()
        wait_for(lambda: shard.health.healthy)
        assert shard.resident_bytes() <= 0.97 * shard.memory_budget_bytes
    finally:
        shard.shutdown()
