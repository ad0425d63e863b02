"""A data dir that refuses writes: the shard recovers by itself when writes work again,
and a stop while they do not saves the unwritten rows to a rescue dump that
``apply_rescue`` writes back into the data dir, exactly once.

The database really refuses writes here: it is reopened read-only in place (what a
RocksDB whose write failed amounts to: it refuses every later write), and a second
read-write handle on it (the "blocker") holds RocksDB's lock so that the shard's own
reopen for writing fails too, until the test closes the blocker.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import rocksdict

from ps.durability import Durability, apply_rescue, begin_epoch, dump_places, is_rescue_dump, save_rescue, settle_dumps
from ps.shard import Shard
from ps.store import DataDirError, RowFormat, Storage, StorageFailed
from ps.table import InitializerKind, InitializerParams, OptimizerKind, OptimizerParams, Table, TableSpec
from tests.fakes import push_request

SPEC = TableSpec(
    "t", 4, initializer=InitializerParams(InitializerKind.ZEROS), optimizer=OptimizerParams(OptimizerKind.SGD, lr=1.0)
)
KEYS = np.arange(100, dtype=np.int64)


def refuse_writes(storage: Storage) -> None:
    """The real database, opened read-only in place: every write now fails."""
    storage._drop_handles()
    storage._db.close()
    storage._db = storage._open(read_only=True)
    storage._bind_handles()


class Blocker:
    """A second read-write handle on the data dir's RocksDB: the shard cannot reopen it
    for writing while this lives."""

    def __init__(self, data_dir: Path) -> None:
        self._db: rocksdict.Rdict | None = rocksdict.Rdict(str(data_dir / "db"), rocksdict.Options(raw_mode=True))

    def release(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


@pytest.fixture
def shard(tmp_path: Path) -> Iterator[Shard]:
    s = Shard(0, 1, Storage(tmp_path / "data", shard=0, num_shards=1), Durability.parse("interval:60"))
    s.create_table(SPEC)
    yield s
    if s.storage is not None and s.storage._db is not None:
        s.shutdown()


def push(shard: Shard, seq: int, keys: npt.NDArray[np.int64] = KEYS) -> None:
    assert shard.push(push_request([("t", keys, -np.ones((keys.shape[0], 4), np.float32))], "w", seq)) == (
        True,
        keys.shape[0],
    )


def rows(shard: Shard) -> npt.NDArray[np.float32]:
    return shard.table("t").lookup(KEYS, create=False)[:, 0].copy()


def reopened(data_dir: Path, rescue_dir: Path | None = None) -> Shard:
    storage = Storage(data_dir, shard=0, num_shards=1)
    return Shard(0, 1, storage, Durability.parse("interval:60"), rescue_dir=rescue_dir)


def test_shard_recovers_by_itself_once_writes_succeed_again(shard: Shard, tmp_path: Path) -> None:
    heard: list[bool] = []
    shard.on_writable_change(heard.append)
    push(shard, 1)
    shard.flush()
    assert shard.table("t").evict(50) == 50  # half the rows only on disk now
    push(shard, 2, KEYS[50:])
    refuse_writes(shard.storage)  # type: ignore[arg-type]
    blocker = Blocker(tmp_path / "data")
    with pytest.raises(StorageFailed):
        shard.flush()
    assert not shard.writable and heard == [False] and shard.storage_error
    np.testing.assert_array_equal(rows(shard), [1] * 50 + [2] * 50)  # reads go on, from disk too
    assert not shard.recover_storage() and heard == [False]  # the blocker holds RocksDB's lock
    blocker.release()
    assert shard.recover_storage()
    assert shard.writable and heard == [False, True] and shard.storage_error == ""
    push(shard, 3)
    shard.shutdown()

    again = reopened(tmp_path / "data")
    try:
        np.testing.assert_array_equal(rows(again), [2] * 50 + [3] * 50)
        assert again.push(push_request([("t", KEYS, np.zeros((100, 4), np.float32))], "w", 3)) == (False, 0)
    finally:
        again.shutdown()


def test_stop_with_a_refusing_disk_saves_a_rescue_dump_that_restores_once(shard: Shard, tmp_path: Path) -> None:
    push(shard, 1)
    shard.flush()
    push(shard, 2, KEYS[:30])  # only in RAM: acknowledged, not written
    expected = rows(shard)
    refuse_writes(shard.storage)  # type: ignore[arg-type]
    blocker = Blocker(tmp_path / "data")
    report = shard.shutdown(grace_s=0.6)
    blocker.release()
    assert not report.clean and not report.lost and report.unpersisted_rows == 30
    assert report.rescue_path is not None and report.rescue_path.parent == tmp_path / "data" / "checkpoints"
    assert is_rescue_dump(report.rescue_path) and not is_rescue_dump(tmp_path / "data")
    manifest = json.loads((report.rescue_path / "manifest.json").read_text())
    assert manifest["kind"] == "rescue" and manifest["data_dir"] == str(tmp_path / "data")
    assert manifest["tables"][0]["rows"] == 30 and "w" in manifest["tables"][0]["ledgers"]

    stale = reopened(tmp_path / "data")  # the data dir alone has push 1 only
    try:
        np.testing.assert_array_equal(rows(stale), np.ones(100))
    finally:
        stale.shutdown()
    with Storage(tmp_path / "data", shard=0, num_shards=1) as st:
        assert apply_rescue(report.rescue_path, st) == {"t": 30}
    restored = reopened(tmp_path / "data")
    try:
        np.testing.assert_array_equal(rows(restored), expected)
        assert restored.push(push_request([("t", KEYS, np.zeros((100, 4), np.float32))], "w", 2)) == (False, 0)
        push(restored, 3)
    finally:
        restored.shutdown()
    with Storage(tmp_path / "data", shard=0, num_shards=1) as st:
        with pytest.raises(DataDirError, match="already applied"):
            apply_rescue(report.rescue_path, st)


def test_a_damaged_or_foreign_dump_changes_nothing(shard: Shard, tmp_path: Path) -> None:
    push(shard, 1)
    refuse_writes(shard.storage)  # type: ignore[arg-type]
    blocker = Blocker(tmp_path / "data")
    dump = shard.shutdown(grace_s=0).rescue_path
    blocker.release()
    assert dump is not None
    with Storage(tmp_path / "other", shard=0, num_shards=2) as other:
        with pytest.raises(DataDirError, match="holds shard 0 of 1"):
            apply_rescue(dump, other)
    with Storage(tmp_path / "fresh", shard=0, num_shards=1) as fresh:
        with pytest.raises(DataDirError, match="has no table 't'.*never to a new one"):
            apply_rescue(dump, fresh)
    data = bytearray((dump / "0.rows").read_bytes())
    data[5] ^= 1
    (dump / "0.rows").write_bytes(bytes(data))
    with Storage(tmp_path / "data", shard=0, num_shards=1) as st:
        with pytest.raises(DataDirError, match="damaged"):
            apply_rescue(dump, st)
        assert st.specs() and not st.table("t", RowFormat(4, 0)).get(KEYS)[0].any()  # no row was written


def test_every_push_mode_needs_no_rescue(tmp_path: Path) -> None:
    shard = Shard(0, 1, Storage(tmp_path / "data", shard=0, num_shards=1), Durability.parse("every-push"))
    shard.create_table(SPEC)
    push(shard, 1)
    shard.table("t").lookup(np.arange(500, 510))  # created by a lookup: written before it returns, too
    refuse_writes(shard.storage)  # type: ignore[arg-type]
    blocker = Blocker(tmp_path / "data")
    report = shard.shutdown(grace_s=5.0)
    blocker.release()
    assert report.clean and report.error and report.rescue_path is None
    assert not list((tmp_path / "data").parent.glob("*.rescue-*"))


def test_when_no_place_takes_the_dump_the_report_says_the_rows_are_lost(shard: Shard, tmp_path: Path) -> None:
    push(shard, 1)
    (tmp_path / "file").write_text("not a directory")
    places = [(tmp_path / "file", "a-"), (tmp_path / "file", "b-")]
    report = save_rescue(shard.tables(), places, (0, 1), tmp_path / "data", "disk full")
    assert report.lost and report.unpersisted_rows == 100 and len(report.rescue_failures) == 2
    assert all("Not a directory" in f for f in report.rescue_failures)


def test_a_push_whose_spill_fails_is_still_acknowledged(tmp_path: Path) -> None:
    # The push is applied before the memory budget makes the shard spill; a spill that
    # fails must not report the applied push as failed (the client would count it lost).
    probe = Shard(0, 1)
    probe.create_table(SPEC)
    per_row = probe.table("t").bytes_per_row
    shard = Shard(
        0,
        1,
        Storage(tmp_path / "data", shard=0, num_shards=1),
        Durability.parse("checkpoint-only"),
        memory_budget_bytes=60 * per_row,
    )
    shard.create_table(SPEC)
    push(shard, 1, KEYS[:50])
    refuse_writes(shard.storage)  # type: ignore[arg-type]
    blocker = Blocker(tmp_path / "data")
    try:
        push(shard, 2, KEYS[50:])  # over the budget: the spill fails, the push stands
        assert not shard.writable
        np.testing.assert_array_equal(rows(shard), [1] * 50 + [1] * 50)
        with pytest.raises(StorageFailed, match="refuses writes"):
            push(shard, 3)
    finally:
        blocker.release()
        shard.shutdown()


def test_a_dump_applies_only_to_the_state_it_was_written_on(tmp_path: Path) -> None:
    data = tmp_path / "data"
    places = dump_places(data, tmp_path / "rescue", None)
    with Storage(data, shard=0, num_shards=1) as st:
        base = begin_epoch(st)  # what a ps-server start does before anything else
    shard = reopened(data, tmp_path / "rescue")
    assert shard.rescue_base == base
    shard.create_table(SPEC)
    push(shard, 1)
    refuse_writes(shard.storage)  # type: ignore[arg-type]
    blocker = Blocker(data)
    dump = shard.shutdown(grace_s=0).rescue_path
    blocker.release()
    assert dump is not None and dump.parent == tmp_path / "rescue"
    manifest = json.loads((dump / "manifest.json").read_text())
    assert (manifest["lineage"], manifest["base_epoch"]) == (base.lineage, base.epoch)

    with Storage(data, shard=0, num_shards=1) as st:
        begin_epoch(st)  # another start wrote the data dir meanwhile (it did not look in tmp_path/rescue)
    with Storage(data, shard=0, num_shards=1) as st:
        with pytest.raises(DataDirError, match="another state of"):
            apply_rescue(dump, st)
        with pytest.raises(
            DataDirError, match=f"never applied: {re.escape(str(dump))} .*--discard-rescue={re.escape(str(dump))}"
        ):
            settle_dumps(st, places)
        assert settle_dumps(st, places, discard=dump) == []
        assert settle_dumps(st, places) == []  # discarded: no longer in the way
        with pytest.raises(DataDirError, match="already discarded"):
            apply_rescue(dump, st)
        assert settle_dumps(st, places, discard=dump) == []  # a setting left in place does no harm
        assert settle_dumps(st, places, discard=tmp_path / "deleted") == []
        with pytest.raises(DataDirError, match="no manifest.json: not a rescue dump"):
            settle_dumps(st, places, discard=tmp_path)
        assert not st.table("t", RowFormat(4, 0)).get(KEYS)[0].any()  # none of its rows was written


def test_a_pending_dump_on_its_own_state_is_applied_by_settle(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with Storage(data, shard=0, num_shards=1) as st:
        begin_epoch(st)
    shard = reopened(data)
    shard.create_table(SPEC)
    push(shard, 1)
    refuse_writes(shard.storage)  # type: ignore[arg-type]
    blocker = Blocker(data)
    dump = shard.shutdown(grace_s=0).rescue_path
    blocker.release()
    with Storage(data, shard=0, num_shards=1) as st:
        assert settle_dumps(st, dump_places(data, None, data / "checkpoints")) == [dump]
        assert settle_dumps(st, dump_places(data, None, data / "checkpoints")) == []
    again = reopened(data)
    try:
        np.testing.assert_array_equal(rows(again), np.ones(100))
    finally:
        again.shutdown()


def test_every_push_lookup_writes_the_rows_it_creates_or_creates_none(tmp_path: Path) -> None:
    spec = TableSpec("u", 4, seed=3)  # random initial rows: a row read back wrong would show
    shard = Shard(0, 1, Storage(tmp_path / "data", shard=0, num_shards=1), Durability.parse("every-push"))
    shard.create_table(spec)
    table = shard.table("u")
    initial = Table(spec).lookup(KEYS)
    np.testing.assert_array_equal(table.lookup(KEYS[:50]), initial[:50])
    assert table.unpersisted_rows() == 0 and table.counters.rows_written == 50
    refuse_writes(shard.storage)  # type: ignore[arg-type]
    blocker = Blocker(tmp_path / "data")
    try:
        seen = table.lookup(KEYS[::-1])  # 50 new rows: their write fails, so they are not created
        assert not shard.writable and "storage write failed" in shard.storage_error
        assert len(table) == 50 and table.counters.rows_created == 50 and table.unpersisted_rows() == 0
        np.testing.assert_array_equal(seen, initial[::-1])  # all read as their initial rows
    finally:
        blocker.release()
    assert shard.recover_storage()
    np.testing.assert_array_equal(table.lookup(KEYS), initial)
    assert len(table) == 100 and table.unpersisted_rows() == 0
    shard.shutdown()
    with Storage(tmp_path / "data", shard=0, num_shards=1) as st:
        found, rec = st.table("u", RowFormat(4, 0)).get(KEYS)
        assert found.all()
        np.testing.assert_array_equal(rec.values, initial)
