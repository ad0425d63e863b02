"""The RAM tier over RocksDB: ``Table`` with storage (evict, fault-in, flush, every-push,
admission, TTL, rare-row deletion) and ``Shard`` (memory budget, storage failure,
checkpoints in test_shard_checkpoints.py).

Time is controlled by a fake recency clock (``now_tick`` patched in ``ps.table.table``
and ``ps.shard``), plus explicit ``now`` ticks where the API takes them.
Storage failures are real: a ``Storage`` opened read-only makes RocksDB refuse writes.
Expected rows come from a RAM-only twin ``Table`` fed the same operations, or from
``initial_rows``, and are compared bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import numpy.typing as npt
import pytest

import ps.shard.budget
import ps.table.lifecycle
import ps.table.table
from ps.durability import Durability
from ps.shard import Shard
from ps.shard.budget import LOW_WATER
from ps.store import RowFormat, Rows, Storage, StorageFailed
from ps.table import Lifecycle, OptimizerKind, OptimizerParams, Table, TableSpec, now_tick
from ps.table.initializers import initial_rows
from ps.table.ledger import PushLedger
from ps.table.lifecycle import TICKS_PER_S
from tests.fakes import push_request

I64 = np.iinfo(np.int64)


class Clock:
    """The recency clock the tables see: whole ticks, set by the test."""

    def __init__(self) -> None:
        self.tick = int(now_tick())

    def __call__(self) -> np.uint32:
        return np.uint32(self.tick & 0xFFFFFFFF)

    def advance(self, ticks: int) -> np.uint32:
        self.tick += ticks
        return self()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    for module in (ps.table.table, ps.shard.budget):
        monkeypatch.setattr(module, "now_tick", c)
    return c


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[Storage]:
    st = Storage(tmp_path / "data", shard=0, num_shards=1)
    yield st
    st.close()


def tiered(st: Storage, spec: TableSpec, every_push: bool = False) -> Table:
    rows = st.table(spec.name, spec.row_format)
    return Table(spec, rows=rows, storage=st, every_push=every_push)


def bits(a: npt.NDArray[np.float32]) -> npt.NDArray[np.uint32]:
    return np.ascontiguousarray(a).view(np.uint32)


def assert_same_bits(a: npt.NDArray[np.float32], b: npt.NDArray[np.float32]) -> None:
    np.testing.assert_array_equal(bits(a), bits(b))


def keys_of(*ks: int) -> npt.NDArray[np.int64]:
    return np.array(ks, dtype=np.int64)


def grads_for(keys: npt.NDArray[np.int64], dim: int, seed: int = 0) -> npt.NDArray[np.float32]:
    return np.random.default_rng(seed).normal(size=(keys.shape[0], dim)).astype(np.float32)


def stored(t: Table) -> dict[int, tuple[list[int], list[int], int, int]]:
    """What the table's column family holds: key -> (value bits, state bits, last_access, frequency)."""
    assert t._disk is not None  # the tier under test
    out = {}
    for rec in t._disk.scan():
        for i, k in enumerate(rec.keys.tolist()):
            out[k] = (
                bits(rec.values[i]).tolist(),
                bits(rec.state[i]).tolist(),
                int(rec.last_access[i]),
                int(rec.frequency[i]),
            )
    return out


def exported(t: Table) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    rows = t.export()
    rows = rows[np.argsort(rows.keys)]
    return rows.keys, rows.values, rows.state


def resident(t: Table, keys: npt.NDArray[np.int64]) -> int:
    """How many of ``keys`` are in RAM (a serving lookup: faults the rest in, creates nothing)."""
    before = t.counters.ram_hits
    t.lookup(keys, create=False)
    return t.counters.ram_hits - before


ADAM = TableSpec("t", 5, optimizer=OptimizerParams(OptimizerKind.ADAM, lr=0.05), seed=7)
SGD = TableSpec("t", 4, optimizer=OptimizerParams(OptimizerKind.SGD, lr=0.5), seed=3)


# -- evict and fault in -------------------------------------------------------------------


def test_rows_faulted_back_match_a_ram_only_twin(storage: Storage, clock: Clock) -> None:
    rng = np.random.default_rng(0)
    pool = np.concatenate([keys_of(I64.min, -1, 0, I64.max), rng.integers(-(10**12), 10**12, size=200)])
    t, twin = tiered(storage, ADAM), Table(ADAM)
    for step in range(1, 16):
        keys = rng.choice(pool, size=48)
        assert_same_bits(t.lookup(keys), twin.lookup(keys))
        keys = rng.choice(pool, size=40)  # duplicates: summed first
        grads = rng.normal(size=(40, ADAM.dim)).astype(np.float32)
        assert t.push(keys, grads, client_id="w", seq=step) == twin.push(keys, grads, client_id="w", seq=step)
        assert t.push(keys, grads, client_id="w", seq=step) is None  # a retry, after an evict or not
        now = clock.advance(int(rng.integers(1, 4)))
        t.evict(int(rng.integers(0, len(t) + 1)), now)
    t.evict(len(t), clock())
    assert len(t) == 0 and t.counters.rows_spilled > 0 and t.counters.rows_faulted_in > 0
    assert_same_bits(t.lookup(pool), twin.lookup(pool))
    tk, tv, ts = exported(t)
    wk, wv, ws = exported(twin)
    np.testing.assert_array_equal(tk, wk)
    assert_same_bits(tv, wv)
    assert_same_bits(ts, ws)


def test_hit_rate_counts_only_keys_whose_row_exists(storage: Storage, clock: Clock) -> None:
    t = tiered(storage, SGD)
    c = t.counters
    t.lookup(keys_of(1, 2, 3, 4))
    assert (c.ram_hits, c.ram_misses, c.rows_created) == (0, 0, 4)  # new rows are neither
    clock.advance(1)
    t.lookup(keys_of(3, 4))
    assert (c.ram_hits, c.ram_misses) == (2, 0)
    assert t.evict(2, clock.advance(1)) == 2  # 1 and 2, the least recently used
    t.lookup(keys_of(3, 1, 1, 7, 7, 2))  # 3 in RAM; 1, 1 and 2 read back from disk; 7 new, twice
    assert (c.ram_hits, c.ram_misses, c.rows_created, c.rows_faulted_in) == (3, 3, 5, 2)
    t.lookup(keys_of(8, 3), create=False)  # no row for 8: not counted either
    assert (c.ram_hits, c.ram_misses) == (4, 3)


def test_evict_writes_dirty_rows_and_does_not_rewrite_clean_ones(storage: Storage, clock: Clock) -> None:
    # (A table without TTL or frequency rules: no recency or count needs persisting.)
    t, twin = tiered(storage, SGD), Table(SGD)
    clean, dirty = keys_of(1, 2, 3), keys_of(-4, 5, I64.max)
    both = np.concatenate([clean, dirty])
    t.lookup(both), twin.lookup(both)
    assert t.flush() == 6 and t.flush() == 0
    push_tick = clock.advance(5)
    g = grads_for(dirty, SGD.dim)
    t.push(dirty, g), twin.push(dirty, g)
    # Overwrite every stored row behind the table's back: what evict rewrites shows.
    other = storage.table("t", RowFormat(SGD.dim, 0))
    batch = storage.batch()
    sentinel = np.full((6, SGD.dim), -7.0, np.float32)
    other.put(
        batch, Rows(both, sentinel, np.empty((6, 0), np.float32), np.full(6, 1, np.uint32), np.full(6, 99, np.uint32))
    )
    storage.commit(batch)

    assert t.evict(10, clock.advance(1)) == 6 and len(t) == 0
    assert t.counters.rows_spilled == 6
    assert t.counters.rows_written == 6 + 3  # the flush, then only the dirty rows
    disk = stored(t)
    for k in clean.tolist():
        assert disk[k] == (bits(sentinel[0]).tolist(), [], 1, 99)
    expected = twin.lookup(dirty)
    for i, k in enumerate(dirty.tolist()):
        assert disk[k] == (bits(expected[i]).tolist(), [], int(push_tick), 1)


def test_flush_writes_dirty_rows_only(storage: Storage, clock: Clock) -> None:
    t = tiered(storage, SGD)
    t.lookup(keys_of(1, 2, 3))
    assert t.flush() == 3 and t.flush() == 0
    t.push(keys_of(2), grads_for(keys_of(2), SGD.dim))
    t.lookup(keys_of(1))  # a lookup does not make a row dirty
    assert t.flush() == 1 and sorted(stored(t)) == [1, 2, 3]


def test_evict_without_storage_is_refused() -> None:
    with pytest.raises(RuntimeError, match="no storage"):
        Table(SGD).evict(1)


# -- every-push ---------------------------------------------------------------------------


def test_every_push_writes_the_rows_and_ledger_before_returning(tmp_path: Path, clock: Clock) -> None:
    keys = keys_of(3, -3, I64.min)
    twin = Table(ADAM)
    with Storage(tmp_path, shard=0, num_shards=1) as st:
        t = tiered(st, ADAM, every_push=True)
        g = grads_for(keys, ADAM.dim)
        t.lookup(keys), twin.lookup(keys)
        assert t.push(keys, g, client_id="w", seq=1) == 3
        twin.push(keys, g, client_id="w", seq=1)
        disk = stored(t)  # nothing flushed: the push itself wrote these
        expected = twin.lookup(keys)
        for i, k in enumerate(keys.tolist()):
            assert disk[k][0] == bits(expected[i]).tolist()
        assert PushLedger.decode(st.table("t", ADAM.row_format).ledgers()["w"]) == (
            1,
            [],
        )
    # no flush, no shutdown: a reopened table has the push, exactly once
    with Storage(tmp_path, shard=0, num_shards=1) as st:
        t = tiered(st, ADAM, every_push=True)
        assert t.push(keys, g, client_id="w", seq=1) is None
        assert_same_bits(t.lookup(keys), expected)
        assert_same_bits(exported(t)[2], exported(twin)[2])


def failing_table(
    tmp_path: Path, spec: TableSpec, keys: npt.NDArray[np.int64], every_push: bool = True
) -> tuple[Table, Storage]:
    """A table whose rows of ``keys`` are on disk (pushed once, seq 1 of client "w"),
    opened on a read-only Storage: RocksDB refuses every write."""
    with Storage(tmp_path / "rw", shard=0, num_shards=1) as st:
        t = tiered(st, spec)
        t.lookup(keys)
        t.push(keys, grads_for(keys, spec.dim), client_id="w", seq=1)
        t.flush()
    ro = Storage(tmp_path / "rw", shard=0, num_shards=1, read_only=True)
    return tiered(ro, spec, every_push=every_push), ro


def test_every_push_write_failure_leaves_ram_unchanged(tmp_path: Path, clock: Clock) -> None:
    keys = keys_of(8, 9, 10)
    t, ro = failing_table(tmp_path, ADAM, keys)
    try:
        before = t.lookup(keys).copy()  # faulted in: reads still work
        state_before = exported(t)[2]
        pushes = t.counters.pushes
        with pytest.raises(StorageFailed) as info:
            t.push(keys, grads_for(keys, ADAM.dim, seed=1), client_id="w", seq=2)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert_same_bits(t.lookup(keys), before)
        assert_same_bits(exported(t)[2], state_before)
        assert t.counters.pushes == pushes
        assert PushLedger.decode(t.ledger.encode("w")) == (1, [])  # seq 2 not recorded
    finally:
        ro.close()


def test_every_push_on_a_closed_storage_fails_cleanly(storage: Storage, clock: Clock) -> None:
    keys = keys_of(1, 2)
    t = tiered(storage, SGD, every_push=True)
    before = t.lookup(keys).copy()
    storage.close()
    with pytest.raises(StorageFailed):
        t.push(keys, grads_for(keys, SGD.dim), client_id="w", seq=1)
    assert_same_bits(t.lookup(keys), before)
    assert PushLedger.decode(t.ledger.encode("w")) == (0, [])


def test_failed_evict_keeps_rows_and_ledger_changes(tmp_path: Path, clock: Clock) -> None:
    keys = keys_of(1, 2, 3)
    t, ro = failing_table(tmp_path, SGD, keys, every_push=False)
    try:
        t.lookup(keys)
        t.push(keys, grads_for(keys, SGD.dim, seed=2), client_id="w", seq=2)
        before = t.lookup(keys).copy()
        with pytest.raises(StorageFailed):
            t.evict(3, clock.advance(1))
        assert len(t) == 3 and resident(t, keys) == 3
        assert_same_bits(t.lookup(keys), before)
        assert t.ledger.take_changed() == ["w"]  # still to be written
    finally:
        ro.close()


# -- admission ----------------------------------------------------------------------------


def test_keys_not_admitted_read_as_initial_rows_and_drop_pushes(storage: Storage, clock: Clock) -> None:
    spec = TableSpec(
        "t", 4, optimizer=OptimizerParams(OptimizerKind.SGD, lr=0.5), seed=5, lifecycle=Lifecycle(admit_after=3)
    )
    t = tiered(storage, spec)
    keys = keys_of(10, -20, I64.max)
    initial = initial_rows(spec.initializer, spec.seed, keys, spec.dim)
    for sighting in (1, 2):
        assert_same_bits(t.lookup(keys), initial)
        assert len(t) == 0 and t.counters.lookups_not_admitted == 3 * sighting
        assert t.push(keys, grads_for(keys, 4)) == 0  # not a sighting; dropped
        assert t.counters.pushes_dropped == 3 * sighting and t.counters.pushes == 0
    assert t.flush() == 0 and stored(t) == {}
    for _ in range(5):  # serving lookups are not sightings either
        assert not t.lookup(keys, create=False).any()
    # the third sighting admits: the row starts from its initial value (pushes were dropped)
    assert_same_bits(t.lookup(keys), initial)
    assert len(t) == 3 and t.counters.lookups_not_admitted == 6 and t.counters.rows_created == 3
    assert t.push(keys, grads_for(keys, 4)) == 3 and t.counters.pushes_dropped == 6
    assert t.flush() == 3 and sorted(stored(t)) == sorted(keys.tolist())


def test_admission_counts_partial_batches(storage: Storage, clock: Clock) -> None:
    spec = TableSpec("t", 2, lifecycle=Lifecycle(admit_after=2))
    t = tiered(storage, spec)
    t.lookup(keys_of(1))
    t.lookup(keys_of(1, 2))  # 1 admitted now, 2 not
    assert len(t) == 1
    assert t.push(keys_of(1, 2, 2), np.ones((3, 2), np.float32)) == 1
    assert t.counters.pushes_dropped == 2


# -- TTL ------------------------------------------------------------------------------------


TTL_S = 10.0
TTL_TICKS = int(TTL_S * TICKS_PER_S)


def test_expire_deletes_idle_rows_from_ram_and_disk(storage: Storage, clock: Clock) -> None:
    spec = TableSpec(
        "t", 3, optimizer=OptimizerParams(OptimizerKind.SGD, lr=0.5), seed=1, lifecycle=Lifecycle(ttl_seconds=TTL_S)
    )
    t = tiered(storage, spec)
    old, new = np.arange(20, dtype=np.int64), np.arange(100, 110, dtype=np.int64)
    t0 = clock()
    t.lookup(old)
    t.push(old, grads_for(old, 3))
    assert t.evict(10, t0) == 10  # half the old rows on disk, half in RAM
    clock.advance(50)
    t.lookup(new)
    t.push(new, grads_for(new, 3))
    t.flush()
    kept = t.lookup(new).copy()
    assert t.expire(np.uint32(int(t0) + TTL_TICKS)) == 0  # exactly ttl old: kept
    assert t.expire(np.uint32(int(t0) + TTL_TICKS + 1)) == 20
    assert t.counters.rows_expired == 20
    assert len(t) == 10 and sorted(stored(t)) == new.tolist()
    assert t.expire(np.uint32(int(t0) + TTL_TICKS + 1)) == 0
    assert_same_bits(t.lookup(old), initial_rows(spec.initializer, spec.seed, old, 3))  # new rows again
    assert_same_bits(t.lookup(new), kept)


def test_expire_is_a_no_op_without_ttl(storage: Storage, clock: Clock) -> None:
    t = tiered(storage, SGD)
    t.lookup(keys_of(1, 2))
    assert t.expire(clock.advance(10**6)) == 0 and len(t) == 2


def test_expire_uses_the_last_use_of_a_row_evicted_clean(storage: Storage, clock: Clock) -> None:
    # A row written at t0, used again at t0+60 ticks without a change (a lookup), then
    # evicted (clean, so not rewritten) was idle for only 21 ticks at t0+81: it must
    # not expire with a 80-tick TTL.
    spec = TableSpec(
        "t", 3, optimizer=OptimizerParams(OptimizerKind.SGD, lr=0.5), seed=1, lifecycle=Lifecycle(ttl_seconds=TTL_S)
    )
    t = tiered(storage, spec)
    k = keys_of(42)
    t0 = int(clock())
    t.lookup(k)
    t.push(k, grads_for(k, 3))
    t.flush()
    clock.advance(60)
    trained = t.lookup(k).copy()
    assert t.evict(1, clock()) == 1
    assert t.expire(np.uint32(t0 + TTL_TICKS + 1)) == 0
    assert_same_bits(t.lookup(k), trained)


# -- rare rows ------------------------------------------------------------------------------


def test_evict_deletes_rare_rows_instead_of_spilling(storage: Storage, clock: Clock) -> None:
    spec = TableSpec(
        "t",
        4,
        optimizer=OptimizerParams(OptimizerKind.SGD, lr=0.5),
        seed=2,
        lifecycle=Lifecycle(evict_below_frequency=3),
    )
    t, twin = tiered(storage, spec), Table(spec)
    rare, frequent = keys_of(1, 2, 3, 4, 5), keys_of(11, 12, 13, 14, 15)
    for tab in (t, twin):
        tab.lookup(rare)
        for _ in range(3):
            tab.lookup(frequent)
        both = np.concatenate([rare, frequent])
        tab.push(both, grads_for(both, 4))
    t.flush()  # the rare rows are on disk too: they must go from there as well
    assert t.evict(10, clock.advance(1)) == 10
    assert t.counters.rows_evicted_rare == 5 and t.counters.rows_spilled == 5
    assert sorted(stored(t)) == frequent.tolist()
    assert_same_bits(t.lookup(frequent), twin.lookup(frequent))
    assert_same_bits(t.lookup(rare), initial_rows(spec.initializer, spec.seed, rare, 4))


def test_lookups_count_towards_frequency_across_a_clean_eviction(storage: Storage, clock: Clock) -> None:
    # Looked up 11 times in all, with a floor of 5: never rare. Its lookups after the last
    # write must not be forgotten when it is evicted clean and faulted back in.
    spec = TableSpec(
        "t",
        4,
        optimizer=OptimizerParams(OptimizerKind.SGD, lr=0.5),
        seed=2,
        lifecycle=Lifecycle(evict_below_frequency=5),
    )
    t = tiered(storage, spec)
    k = keys_of(7)
    t.lookup(k)
    t.push(k, grads_for(k, 4))
    t.flush()
    for _ in range(9):
        t.lookup(k)
    trained = t.lookup(k).copy()
    assert t.evict(1, clock.advance(1)) == 1 and t.counters.rows_evicted_rare == 0
    t.lookup(k)  # faulted back in
    assert t.evict(1, clock.advance(1)) == 1
    assert t.counters.rows_evicted_rare == 0
    assert_same_bits(t.lookup(k), trained)


def test_evict_keeps_rows_used_while_it_scanned_outside_the_lock(
    storage: Storage, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Evict picks victims outside the table lock: a row looked up and one pushed between
    # that scan and the check under the lock stay in RAM, and the pushed row keeps its push.
    t, twin = tiered(storage, SGD), Table(SGD)
    keys = np.arange(10, dtype=np.int64)
    t.lookup(keys), twin.lookup(keys)
    scan = ps.table.lifecycle.select_victims
    used = keys_of(3, 7)

    def scan_then_use(*args: object, **kwargs: object) -> object:
        found = scan(*args, **kwargs)  # type: ignore[arg-type]
        t.lookup(used[:1])
        t.push(used[1:], grads_for(used[1:], SGD.dim))
        return found

    monkeypatch.setattr(ps.table.table, "select_victims", scan_then_use)
    twin.push(used[1:], grads_for(used[1:], SGD.dim))
    assert t.evict(10, clock.advance(3)) == 8 and len(t) == 2
    assert resident(t, used) == 2
    assert_same_bits(t.lookup(keys, create=False), twin.lookup(keys, create=False))


# -- Shard: memory budget -------------------------------------------------------------------


def test_lru_budget_spills_the_oldest_rows_across_tables(storage: Storage, clock: Clock) -> None:
    shard = Shard(0, 1, storage, Durability.parse("checkpoint-only"), memory_budget_bytes=1 << 40, eviction="lru")
    shard.create_table(TableSpec("a", 4))
    shard.create_table(TableSpec("b", 32, optimizer=OptimizerParams(OptimizerKind.ADAGRAD)))
    a, b = shard.table("a"), shard.table("b")
    ka, kb = np.arange(100, dtype=np.int64), np.arange(1000, 1100, dtype=np.int64)
    # every row its own tick: all of a is older than all of b
    for tab, keys in ((a, ka), (b, kb)):
        for k in keys:
            clock.advance(1)
            tab.lookup(keys_of(int(k)))
    values_b = exported(b)[1]  # (a lookup would make every row of b the same age)
    clock.advance(1)
    total = shard.resident_bytes()
    assert total == 100 * a.bytes_per_row + 100 * b.bytes_per_row
    low = 70 * b.bytes_per_row + b.bytes_per_row // 2
    shard.budget.limit_bytes = int(low / LOW_WATER) + 1
    low = int(LOW_WATER * shard.budget.limit_bytes)
    need = total - low
    b_out = -(-(need - 100 * a.bytes_per_row) // b.bytes_per_row)
    assert 0 < b_out < 100

    assert shard.budget.enforce() == 100 + b_out
    assert len(a) == 0 and len(b) == 100 - b_out
    assert low - b.bytes_per_row < shard.resident_bytes() <= low
    assert shard.budget.enforce() == 0  # under the budget: nothing to do
    assert resident(b, kb[b_out:]) == 100 - b_out  # the most recent rows stayed
    assert resident(b, kb[:b_out]) == 0  # the oldest left (and are faulted back now)
    assert_same_bits(b.lookup(kb, create=False), values_b)  # kb is sorted, like exported()


def test_lfu_budget_spills_the_least_looked_up_rows_across_tables(storage: Storage, clock: Clock) -> None:
    shard = Shard(0, 1, storage, Durability.parse("checkpoint-only"), memory_budget_bytes=1 << 40)
    assert shard.budget.eviction == "lfu"  # the default
    shard.create_table(TableSpec("a", 4))
    shard.create_table(TableSpec("b", 4))
    a, b = shard.table("a"), shard.table("b")
    ka, kb = np.arange(100, dtype=np.int64), np.arange(1000, 1100, dtype=np.int64)
    hot_a, hot_b = ka[::2], kb[:10]
    for _ in range(5):  # hot rows of a: 6 lookups each, all long ago
        a.lookup(hot_a)
    a.lookup(ka)
    clock.advance(100)
    b.lookup(kb)  # every row of b: 1 lookup, recent ...
    for _ in range(2):
        b.lookup(hot_b)  # ... but 10 of them 3
    clock.advance(1)
    values_a, values_b = exported(a)[1], exported(b)[1]
    shard.budget.limit_bytes = int(70 * a.bytes_per_row / LOW_WATER) + 1
    assert shard.budget.enforce() == 130
    # Out went the rows looked up once: the cold half of a, then 80 of b's 90 (of those
    # equally rare, the older first); in stayed the hot rows of a (old as they are) and of b.
    assert resident(a, hot_a) == 50 and resident(a, ka[1::2]) == 0
    assert resident(b, hot_b) == 10 and len(b) == 20
    assert_same_bits(a.lookup(ka, create=False), values_a)
    assert_same_bits(b.lookup(kb, create=False), values_b)


def test_pushes_keep_the_shard_within_its_budget(storage: Storage, clock: Clock) -> None:
    shard = Shard(0, 1, storage, memory_budget_bytes=1)
    shard.create_table(TableSpec("a", 8))
    shard.budget.limit_bytes = 50 * shard.table("a").bytes_per_row
    t = shard.table("a")
    for step in range(1, 6):
        keys = np.arange(step * 100, step * 100 + 40, dtype=np.int64)
        clock.advance(1)
        shard.push(push_request([("a", keys, grads_for(keys, 8))], "w", step))
        assert shard.resident_bytes() <= shard.memory_budget_bytes
    assert t.counters.rows_spilled > 0 and len(t) + t.spilled == 200


# -- Shard: storage failure -----------------------------------------------------------------


def test_storage_failure_makes_the_shard_read_only_once(tmp_path: Path, clock: Clock) -> None:
    keys = keys_of(1, 2, 3)
    rw = Shard(0, 1, Storage(tmp_path, shard=0, num_shards=1))
    rw.create_table(SGD)
    rw.push(push_request([("t", keys, grads_for(keys, SGD.dim))], "w", 1))
    values = rw.table("t").lookup(keys).copy()
    rw.shutdown()

    ro = Storage(tmp_path, shard=0, num_shards=1, read_only=True)
    try:
        shard = Shard(0, 1, ro, Durability.parse("every-push"))
        heard: list[bool] = []
        shard.on_writable_change(heard.append)
        t = shard.table("t")
        assert shard.writable
        with pytest.raises(StorageFailed):
            shard.push(push_request([("t", keys, grads_for(keys, SGD.dim, seed=1))], "w", 2))
        assert not shard.writable and heard == [False]
        with pytest.raises(StorageFailed, match="refuses writes since its storage failed") as info:
            shard.push(push_request([("t", keys, grads_for(keys, SGD.dim, seed=1))], "w", 3))
        assert "lookups still work" in str(info.value) and "retries by itself" in str(info.value)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(StorageFailed):
            shard.create_table(TableSpec("other", 2))
        assert heard == [False]
        assert_same_bits(t.lookup(keys), values)  # reads keep working (faulted in from disk)
        assert shard.budget.enforce() == 0
    finally:
        ro.close()
