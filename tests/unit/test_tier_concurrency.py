"""Spills racing requests. Eviction and the interval flush write their copies with the
table lock released (``ps.table.tier``): while RocksDB writes, lookups and pushes go on.

Each test runs threads against one real table on a real RocksDB directory, then checks
every row, in RAM and on disk, bit for bit against a RAM-only twin fed the same pushes
in the same order (one pusher thread, so the order is known). Checkpoints taken while
pushes and background eviction run must each equal the twin after exactly the pushes
their ledger records.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from ps.durability import Durability
from ps.shard import Shard
from ps.store import Storage
from ps.table import OptimizerKind, OptimizerParams, Table, TableSpec
from ps.table.ledger import PushLedger
from tests.fakes import push_request

SPEC = TableSpec("t", 6, optimizer=OptimizerParams(OptimizerKind.ADAGRAD, lr=0.1), seed=5)
POOL = np.arange(-300, 300, dtype=np.int64) * 7919
PUSHES = 300

Push = tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]


def pushes(seed: int) -> list[Push]:
    rng = np.random.default_rng(seed)
    return [
        (rng.choice(POOL, size=48), rng.normal(size=(48, SPEC.dim)).astype(np.float32))  # duplicates summed
        for _ in range(PUSHES)
    ]


def twin_after(applied: list[Push]) -> Table:
    twin = Table(SPEC)
    twin.lookup(POOL)
    for seq, (keys, grads) in enumerate(applied, 1):
        twin.push(keys, grads, client_id="w", seq=seq)
    return twin


def rows_of(t: Table) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.uint32]]:
    """Values and state bits of every pool key (faulting spilled rows in)."""
    t.lookup(POOL, create=False)
    rows = t.export()
    keys, values, state = rows.keys, rows.values, rows.state
    order = np.argsort(keys)
    assert np.array_equal(keys[order], np.sort(POOL))
    return values[order].view(np.uint32), state[order].view(np.uint32)


def assert_same_rows(t: Table, twin: Table) -> None:
    (tv, ts), (wv, ws) = rows_of(t), rows_of(twin)
    np.testing.assert_array_equal(tv, wv)
    np.testing.assert_array_equal(ts, ws)


def run_threads(*targets: Callable[[threading.Event], None], main: Callable[[], None]) -> None:
    """Run ``targets`` until ``main`` returns; re-raise the first error of any of them."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def guarded(fn: Callable[[threading.Event], None]) -> None:
        try:
            fn(stop)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=guarded, args=(fn,)) for fn in targets]
    for th in threads:
        th.start()
    try:
        main()
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=60)
    if errors:
        raise errors[0]


@pytest.fixture(autouse=True)
def frequent_thread_switches() -> Iterator[None]:
    """Hand the GIL over every few microseconds (default: 5 ms), so that threads
    interleave inside the short windows between a spill's copy and its write."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(before)


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[Storage]:
    st = Storage(tmp_path / "data", shard=0, num_shards=1)
    yield st
    st.close()


def tiered(st: Storage, every_push: bool) -> Table:
    rows = st.table(SPEC.name, SPEC.row_format)
    return Table(SPEC, rows=rows, storage=st, every_push=every_push)


@pytest.mark.parametrize("every_push", [False, True], ids=["interval", "every-push"])
def test_rows_stay_exact_while_spills_race_pushes_and_lookups(storage: Storage, every_push: bool) -> None:
    t = tiered(storage, every_push)  # rows are created by the racing lookups and pushes
    stream = pushes(seed=1)

    def evict(stop: threading.Event) -> None:
        rng = np.random.default_rng(2)
        while not stop.is_set():
            t.evict(int(rng.integers(1, len(POOL))))
            if rng.random() < 0.2:
                t.flush()

    def look(stop: threading.Event) -> None:
        rng = np.random.default_rng(3)
        while not stop.is_set():
            t.lookup(rng.choice(POOL, size=64))

    def push_all() -> None:
        for seq, (keys, grads) in enumerate(stream, 1):
            assert t.push(keys, grads, client_id="w", seq=seq) is not None
            if seq == len(stream) // 2:
                # On a loaded machine the other threads may not have run yet: let spills and
                # fault-ins start before the second half of the pushes, so they race it.
                deadline = time.monotonic() + 30
                while not (t.counters.rows_spilled and t.counters.rows_faulted_in) and time.monotonic() < deadline:
                    time.sleep(0.01)

    run_threads(evict, look, main=push_all)
    assert t.counters.rows_spilled > 0 and t.counters.rows_faulted_in > 0
    t.lookup(POOL)  # any key neither thread reached: created now, as the twin has it
    twin = twin_after(stream)
    assert_same_rows(t, twin)
    # What is on disk is exact too: write everything, drop RAM, read it all back.
    t.flush(metadata=True)
    t.evict(len(t))
    assert len(t) == 0
    assert_same_rows(t, twin)


def test_checkpoints_taken_during_background_eviction_are_consistent_cuts(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "data", shard=0, num_shards=1)
    probe = Table(SPEC)
    # Room for a third of the pool: the evictor thread spills all the time.
    shard = Shard(
        0,
        1,
        storage,
        Durability.parse("interval:0.05"),
        memory_budget_bytes=len(POOL) // 3 * probe.bytes_per_row,
        checkpoint_root=tmp_path,
    )
    shard.create_table(SPEC)
    t = shard.table("t")
    for start in range(0, len(POOL), 100):
        t.lookup(POOL[start : start + 100])
        shard.budget.after_request()
    shard.start()
    stream = pushes(seed=4)
    cuts: list[Path] = []

    def push_all(stop: threading.Event) -> None:
        for seq, (keys, grads) in enumerate(stream, 1):
            if stop.is_set():
                return
            shard.push(push_request([("t", keys, grads)], "w", seq))

    def checkpoint_while_pushing() -> None:
        for i in range(4):
            threading.Event().wait(0.05)
            cuts.append(shard.checkpoint(tmp_path / f"ckpt-{i}")[0])

    try:
        run_threads(push_all, main=checkpoint_while_pushing)
        assert t.counters.rows_spilled > 0
    finally:
        shard.close()
        shard.shutdown()
    seen = set()
    for path in cuts:
        with Storage(path, shard=0, num_shards=1, read_only=True) as ck:
            rows = ck.table(SPEC.name, SPEC.row_format)
            low, done = PushLedger.decode(rows.ledgers()["w"])
            assert not done, "one pusher, in order: the applied pushes are a prefix"
            restored = Table(SPEC, rows=rows, storage=ck)
            assert_same_rows(restored, twin_after(stream[:low]))
        seen.add(low)
    assert len(seen) > 1, f"checkpoints all saw the same push count {seen}: no race was exercised"
