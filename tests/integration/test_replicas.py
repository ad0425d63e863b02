"""Replicas against real ``ps-server`` processes on 127.0.0.1: failover through a ``kill -9``
and back after a restart, hedging around a stopped (SIGSTOP) replica, ``degrade=True`` for a
stopped shard, and writes refused on a replicated shard.

Two processes started as ``--shard 0 --num-shards 1`` answer alike: a row is a function of
(table seed, key) until it is pushed, and these tests never push. Every process is resumed
(SIGCONT) and stopped in ``finally``; each test takes a few seconds.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from client import ClientConfig, DeadlineExceededError, InvalidRequestError, LookupResult, PSClient
from protos.keys import shard_of
from tests.integration.shards import RunningShard, start_shard, stop_shard

DIM = 8
KEYS = np.arange(-500, 1500, 7, dtype=np.int64)


def start_replica(root: Path, index: int = 0, num_shards: int = 1, listen: str = "127.0.0.1:0") -> RunningShard:
    """Shard ``index`` of ``num_shards`` with its own data dir under ``root`` (a restart keeps its tables)."""
    return start_shard(index, num_shards, root, f"--data-dir={root / 'data'}", "--durability=every-push", listen=listen)


def stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped (the signal is delivered asynchronously:
    a call sent at once could still be answered)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[0] not in ("T", "t"):
        assert time.monotonic() < deadline, f"process {pid} did not stop in 10 s"
        time.sleep(0.005)


def create_table(addresses: list[str]) -> None:
    """Table ``t`` on each address, as a one-replica cluster of its own."""
    for a in addresses:
        with PSClient([a]) as one:
            one.create_table("t", DIM, seed=7)


def finish(processes: list[RunningShard]) -> None:
    """Resume and stop every process still running; each must exit 0."""
    for p in processes:
        if p.proc.poll() is None:
            os.kill(p.proc.pid, signal.SIGCONT)
    for p in processes:
        if p.proc.poll() is None:
            stop_shard(p)


@pytest.fixture
def processes() -> Iterator[list[RunningShard]]:
    """Every shard process a test starts; all are resumed and stopped at the end."""
    started: list[RunningShard] = []
    try:
        yield started
    finally:
        finish(started)


def lookups_on(ps: PSClient, address: str) -> int:
    """Keys the replica at ``address`` looked up since it started (from its Stats)."""
    (stats,) = [s for s in ps.admin.stats() if s["address"] == address]
    return sum(t["lookups"] for t in stats["tables"])


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout_s} s: {what}")
        time.sleep(0.02)


def test_reads_survive_a_killed_replica_and_it_comes_back(tmp_path: Path, processes: list[RunningShard]) -> None:
    a, b = (start_replica(tmp_path / name) for name in "ab")
    processes += [a, b]
    create_table([a.address, b.address])
    config = ClientConfig(deadline_s=5.0, eject_s=0.2, eject_max_s=0.4, backoff_max_s=0.2, tune_malloc=False)
    with PSClient([[a.address, b.address]], config) as ps:
        want = ps.lookup("t", KEYS)
        errors: list[BaseException] = []
        done = 0
        stop = threading.Event()

        def read() -> None:
            nonlocal done
            while not stop.is_set():
                try:
                    np.testing.assert_array_equal(ps.lookup("t", KEYS), want)
                    done += 1
                except BaseException as exc:  # any failure fails the test below
                    errors.append(exc)
                    return

        readers = [threading.Thread(target=read) for _ in range(2)]
        for t in readers:
            t.start()
        try:
            time.sleep(0.3)
            a.proc.kill()  # kill -9: no goodbye, the address refuses connections
            a.proc.wait()
            wait_for(
                lambda: ps.admin.replica_health()[0]["state"] != "in_service", 3.0, "the killed replica is ejected"
            )
            before = done
            time.sleep(0.3)
            assert done > before, "reads stopped while the other replica serves"
            restarted = start_replica(tmp_path / "a", listen=a.address)  # same port, same data dir
            processes.append(restarted)
            wait_for(
                lambda: ps.admin.replica_health()[0]["state"] == "in_service", 5.0, "the restarted replica is back"
            )
            # Back in service, it takes its share of reads again (far more than one probe).
            wait_for(lambda: lookups_on(ps, a.address) >= 5 * len(KEYS), 3.0, "reads reach the restarted replica")
        finally:
            stop.set()
            for t in readers:
                t.join(10)
    assert not errors, f"{len(errors)} reads failed, first: {errors[0]!r}"
    assert done > 20


def test_hedged_reads_go_around_a_stopped_replica(tmp_path: Path, processes: list[RunningShard]) -> None:
    a, b = (start_replica(tmp_path / name) for name in "ab")
    processes += [a, b]
    create_table([a.address, b.address])
    config = ClientConfig(deadline_s=5.0, hedge_after_s=0.05, tune_malloc=False)
    with PSClient([[a.address, b.address]], config) as ps:
        want = ps.lookup("t", KEYS)
        stop(a.proc.pid)
        try:
            slowest = 0.0
            for _ in range(20):
                started = time.monotonic()
                np.testing.assert_array_equal(ps.lookup("t", KEYS), want)
                slowest = max(slowest, time.monotonic() - started)
            health = ps.admin.replica_health()
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)
    assert slowest < 1.0, f"slowest read {slowest:.3f} s with hedge_after_s=0.05, deadline_s=5"
    assert health[0]["state"] in ("ejected", "probing"), health  # it lost the races it was sent


def test_degrade_answers_a_stopped_shard_with_default_rows(tmp_path: Path, processes: list[RunningShard]) -> None:
    shards = [start_replica(tmp_path / str(i), i, 2) for i in range(2)]
    processes += shards
    on_1 = shard_of(KEYS, 2) == 1
    with PSClient([s.address for s in shards], ClientConfig(tune_malloc=False)) as ps:
        ps.create_table("t", DIM, seed=7)
        healthy = ps.lookup_many({"t": KEYS})
        stop(shards[1].proc.pid)
        try:
            started = time.monotonic()
            result = ps.lookup_many({"t": KEYS}, degrade=True, deadline_s=0.5)
            took = time.monotonic() - started
            started = time.monotonic()
            with pytest.raises(DeadlineExceededError, match=rf"shard 1 \({shards[1].address}\)") as info:
                ps.lookup_many({"t": KEYS}, deadline_s=0.5)
            took_strict = time.monotonic() - started
        finally:
            os.kill(shards[1].proc.pid, signal.SIGCONT)
        again: npt.NDArray[np.float32] = ps.lookup("t", KEYS)
    assert isinstance(result, LookupResult) and result.degraded == (1,)
    assert 0.45 < took < 1.5 and 0.45 < took_strict < 1.5, (took, took_strict)
    rows = result["t"]
    assert on_1.any() and not rows[on_1].any()
    np.testing.assert_array_equal(rows[~on_1], healthy["t"][~on_1])
    assert info.value.shard == 1
    np.testing.assert_array_equal(again, healthy["t"])  # resumed, it answers again


def test_writes_to_a_replicated_shard_are_refused(tmp_path: Path, processes: list[RunningShard]) -> None:
    a, b = (start_replica(tmp_path / name) for name in "ab")
    processes += [a, b]
    create_table([a.address, b.address])
    with PSClient([[a.address, b.address]], ClientConfig(tune_malloc=False)) as ps:
        refused = f"shard 0 has 2 replicas \\({a.address}\\|{b.address}\\); replicas are read-only"
        with pytest.raises(InvalidRequestError, match=refused):
            ps.push("t", KEYS[:4], np.ones((4, DIM), np.float32))
        with pytest.raises(InvalidRequestError, match=refused):
            ps.create_table("u", DIM)
        with pytest.raises(InvalidRequestError, match=refused):
            ps.admin.checkpoint()
        stats = ps.admin.stats()
        assert ps.admin.tables()["t"].dim == DIM
    assert [s["address"] for s in stats] == [a.address, b.address]
    assert [(s["shard"], s["num_shards"]) for s in stats] == [(0, 1), (0, 1)]
    assert all(t["pushes"] == 0 for s in stats for t in s["tables"])  # nothing reached either replica
