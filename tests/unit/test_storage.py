"""ps.store.storage (one data directory: RocksDB rows, specs, ledgers, checkpoints) and the
persisted form of ps.table.ledger.PushLedger.

Everything runs on a real RocksDB under ``tmp_path``. Rows are compared bit for bit
(through ``uint32`` views), so NaN payloads, infinities and denormals must survive too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from ps.durability import copy_checkpoint
from ps.store import DataDirError, RowFormat, Rows, Storage, StorageFailed, TableRows, read_manifest
from ps.table.ledger import PushLedger

REPO = Path(__file__).resolve().parents[2]
I64 = np.iinfo(np.int64)
DIM, WIDTH = 3, 4  # state_width differs from dim, so a mixed-up split shows


def bits(a: npt.NDArray[np.generic]) -> npt.NDArray[np.uint32]:
    return np.ascontiguousarray(a).view(np.uint32)


def random_rows(keys: npt.NDArray[np.int64], seed: int = 0, dim: int = DIM, width: int = WIDTH) -> Rows:
    """Rows of ``keys`` with arbitrary 32-bit patterns as values/state (NaNs with payloads included)."""
    rng = np.random.default_rng(seed)
    n = keys.shape[0]

    def words(*shape: int) -> npt.NDArray[np.uint32]:
        return rng.integers(0, 2**32, size=shape, dtype=np.uint64).astype(np.uint32)

    return Rows(keys, words(n, dim).view(np.float32), words(n, width).view(np.float32), words(n), words(n))


def put_rows(st: Storage, rows: TableRows, keys: npt.NDArray[np.int64], seed: int = 0) -> Rows:
    data = random_rows(keys, seed, rows.format.dim, rows.format.state_width)
    batch = st.batch()
    rows.put(batch, data)
    st.commit(batch)
    return data


def assert_records(got: Rows, want: Rows) -> None:
    np.testing.assert_array_equal(got.keys, want.keys)
    np.testing.assert_array_equal(bits(got.values), bits(want.values))
    np.testing.assert_array_equal(bits(got.state), bits(want.state))
    np.testing.assert_array_equal(got.last_access, want.last_access)
    np.testing.assert_array_equal(got.frequency, want.frequency)


def scan_all(rows: TableRows, chunk: int = 1 << 16) -> dict[int, tuple[list[int], list[int], int, int]]:
    out = {}
    for rec in rows.scan(chunk):
        for i, k in enumerate(rec.keys.tolist()):
            out[k] = (
                bits(rec.values[i]).tolist(),
                bits(rec.state[i]).tolist(),
                int(rec.last_access[i]),
                int(rec.frequency[i]),
            )
    return out


KEYS = np.array([I64.min, I64.min + 1, -(2**40), -1, 0, 1, 2**40, I64.max - 1, I64.max], dtype=np.int64)


# -- rows ---------------------------------------------------------------------------


def test_put_get_round_trip_is_bit_exact_for_extreme_keys(tmp_path: Path) -> None:
    with Storage(tmp_path, shard=0, num_shards=1) as st:
        rows = st.table("t", RowFormat(DIM, WIDTH))
        data = put_rows(st, rows, KEYS)
        order = np.random.default_rng(1).permutation(KEYS.shape[0])
        found, rec = rows.get(KEYS[order])
        assert found.all()
        assert_records(rec, data[order])


def test_synced_commits_survive_reopen(tmp_path: Path) -> None:
    with Storage(tmp_path, shard=0, num_shards=1, sync=True) as st:
        data = put_rows(st, st.table("t", RowFormat(DIM, WIDTH)), KEYS)
    with Storage(tmp_path, shard=0, num_shards=1) as st:
        found, rec = st.table("t", RowFormat(DIM, WIDTH)).get(KEYS)
        assert found.all()
        assert_records(rec, data)


def test_get_of_absent_keys_returns_only_the_stored_rows_in_key_order(tmp_path: Path) -> None:
    with Storage(tmp_path, shard=0, num_shards=1) as st:
        rows = st.table("t", RowFormat(DIM, WIDTH))
        stored = np.array([-5, 10, I64.max], dtype=np.int64)
        data = put_rows(st, rows, stored)
        ask = np.array([11, I64.max, -4, -5, I64.min, 10, 10], dtype=np.int64)
        found, rec = rows.get(ask)
        assert found.tolist() == [False, True, False, True, False, True, True]
        assert_records(rec, data[[2, 0, 1, 1]])

        found, rec = rows.get(np.array([1, 2], dtype=np.int64))
        assert found.tolist() == [False, False] and rec.values.shape == (0, DIM) and rec.state.shape == (0, WIDTH)
        found, rec = rows.get(np.empty(0, dtype=np.int64))
        assert found.shape == (0,) and rec.values.shape == (0, DIM)


def test_state_width_zero_round_trips(tmp_path: Path) -> None:
    with Storage(tmp_path, shard=0, num_shards=1) as st:
        rows = st.table("sgd", RowFormat(5, 0))
        data = put_rows(st, rows, KEYS)
        found, rec = rows.get(KEYS)
        assert found.all() and rec.state.shape == (KEYS.shape[0], 0)
        assert_records(rec, data)


def test_delete_and_overwrite(tmp_path: Path) -> None:
    with Storage(tmp_path, shard=0, num_shards=1) as st:
        rows = st.table("t", RowFormat(DIM, WIDTH))
        put_rows(st, rows, KEYS, seed=0)
        newer = put_rows(st, rows, KEYS[:2], seed=9)
        batch = st.batch()
        rows.delete(batch, KEYS[-3:])
        rows.delete(batch, np.array([12345], dtype=np.int64))  # absent: a no-op
        st.commit(batch)
        found, rec = rows.get(KEYS)
        assert found.tolist() == [True] * (KEYS.shape[0] - 3) + [False] * 3
        assert_records(rec[:2], newer)


def test_nothing_is_written_before_commit(tmp_path: Path) -> None:
    with Storage(tmp_path, shard=0, num_shards=1) as st:
        rows = st.table("t", RowFormat(DIM, WIDTH))
        batch = st.batch()
        rows.put(batch, random_rows(KEYS))
        assert not rows.get(KEYS)[0].any()
        st.commit(batch)
        assert rows.get(KEYS)[0].all()


def test_scan_returns_every_row_in_chunks_and_tables_are_separate(tmp_path: Path) -> None:
    with Storage(tmp_path, shard=0, num_shards=1) as st:
        a, b = st.table("a", RowFormat(DIM, WIDTH)), st.table("a2", RowFormat(2, 0))
        keys = np.concatenate([KEYS, np.arange(100, 110, dtype=np.int64)])
        data = put_rows(st, a, keys)
        put_rows(st, b, np.array([100, 7], dtype=np.int64), seed=3)
        sizes = [len(part) for part in a.scan(chunk=4)]
        assert sizes == [4, 4, 4, 4, 3]
        got = scan_all(a, chunk=4)
        assert sorted(got) == sorted(keys.tolist())
        for i, k in enumerate(keys.tolist()):
            want = (bits(data.values[i]).tolist(), bits(data.state[i]).tolist())
            assert got[k] == (*want, int(data.last_access[i]), int(data.frequency[i]))
        assert sorted(scan_all(b)) == [7, 100]
        assert list(st.table("empty", RowFormat(1, 0)).scan()) == []


# -- specs, ledgers, reopening --------------------------------------------------------


def test_rows_specs_and_ledgers_survive_close_and_reopen(tmp_path: Path) -> None:
    with Storage(tmp_path, shard=1, num_shards=3) as st:
        t, t2 = st.table("t", RowFormat(DIM, WIDTH)), st.table("t2", RowFormat(DIM, WIDTH))
        data = put_rows(st, t, KEYS)
        st.save_spec("t", b"spec of t")
        st.save_spec("t2", b"\x00\xffbinary")
        batch = st.batch()
        t.put_ledger(batch, "w0", b"ledger t w0")
        t.put_ledger(batch, "w1", b"ledger t w1")
        t2.put_ledger(batch, "w0", b"ledger t2 w0")
        st.commit(batch)
    with Storage(tmp_path, shard=1, num_shards=3) as st:
        assert st.identity() == (1, 3)
        assert st.specs() == {"t": b"spec of t", "t2": b"\x00\xffbinary"}
        t, t2 = st.table("t", RowFormat(DIM, WIDTH)), st.table("t2", RowFormat(DIM, WIDTH))
        assert t.ledgers() == {"w0": b"ledger t w0", "w1": b"ledger t w1"}
        assert t2.ledgers() == {"w0": b"ledger t2 w0"}
        found, rec = t.get(KEYS)
        assert found.all()
        assert_records(rec, data)
        assert not t2.get(KEYS)[0].any()


def test_save_spec_replaces_the_old_one(tmp_path: Path) -> None:
    with Storage(tmp_path, shard=0, num_shards=1) as st:
        st.save_spec("t", b"one")
        st.save_spec("t", b"two")
        assert st.specs() == {"t": b"two"}


# -- the lock and the identity ----------------------------------------------------------


def test_second_open_in_the_same_process_is_refused_until_closed(tmp_path: Path) -> None:
    first = Storage(tmp_path, shard=0, num_shards=1)
    try:
        with pytest.raises(DataDirError, match="in use") as info:
            Storage(tmp_path, shard=0, num_shards=1)
        assert str(tmp_path) in str(info.value)
        assert f"pid {os.getpid()}" in str(info.value)
    finally:
        first.close()
    Storage(tmp_path, shard=0, num_shards=1).close()


def test_open_from_another_process_is_refused(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        from ps.store import DataDirError, Storage
        try:
            Storage({str(tmp_path)!r}, shard=0, num_shards=1)
        except DataDirError as exc:
            print(exc)
            sys.exit(3)
        sys.exit(0)
        """
    )
    with Storage(tmp_path, shard=0, num_shards=1):
        proc = subprocess.run(
            [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
        )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "in use" in proc.stdout


def test_other_shard_identity_is_refused_naming_the_stored_one(tmp_path: Path) -> None:
    Storage(tmp_path, shard=0, num_shards=2).close()
    for shard, num_shards in [(1, 2), (0, 3)]:
        with pytest.raises(DataDirError) as info:
            Storage(tmp_path, shard=shard, num_shards=num_shards)
        message = str(info.value)
        assert "holds shard 0 of 2" in message and "--shard 0 --num-shards 2" in message
        assert f"shard {shard} of {num_shards}" in message


def test_a_refused_open_releases_the_directory(tmp_path: Path) -> None:
    Storage(tmp_path, shard=0, num_shards=2).close()
    with pytest.raises(DataDirError, match="holds shard 0 of 2") as info:
        Storage(tmp_path, shard=1, num_shards=2)
    # The caller still holds the exception (and so its traceback): the directory's lock
    # and RocksDB must have been released by the failed constructor itself, not by GC.
    assert info.value is not None
    with Storage(tmp_path, shard=0, num_shards=2) as st:
        assert st.identity() == (0, 2)


# -- checkpoints ----------------------------------------------------------------------


def make_checkpoint(tmp_path: Path) -> tuple[Path, Rows]:
    ck = tmp_path / "ck"
    with Storage(tmp_path / "data", shard=0, num_shards=1) as st:
        rows = st.table("t", RowFormat(DIM, WIDTH))
        data = put_rows(st, rows, KEYS)
        st.save_spec("t", b"spec")
        st.checkpoint(ck, {"version": "x", "rows": {"t": int(KEYS.shape[0])}})
    return ck, data


def test_checkpoint_opens_read_only_with_every_row(tmp_path: Path) -> None:
    ck, data = make_checkpoint(tmp_path)
    assert read_manifest(ck)["version"] == "x"
    with Storage(ck, shard=0, num_shards=1, read_only=True) as ro:
        assert ro.identity() == (0, 1) and ro.specs() == {"t": b"spec"}
        rows = ro.table("t", RowFormat(DIM, WIDTH))
        found, rec = rows.get(KEYS)
        assert found.all()
        assert_records(rec, data)
        assert sorted(scan_all(rows)) == sorted(KEYS.tolist())
        batch = ro.batch()
        rows.delete(batch, KEYS)
        with pytest.raises(StorageFailed):
            ro.commit(batch)
        with pytest.raises(DataDirError, match="no column family"):
            ro.table("absent", RowFormat(1, 0))


def test_read_only_open_checks_identity_and_needs_a_db(tmp_path: Path) -> None:
    ck, _ = make_checkpoint(tmp_path)
    with pytest.raises(DataDirError, match="holds shard 0 of 1"):
        Storage(ck, shard=1, num_shards=2, read_only=True)
    with Storage(ck, shard=-1, num_shards=0, read_only=True) as ro:  # -1: accept any identity
        assert ro.identity() == (0, 1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataDirError, match="no db/"):
        Storage(tmp_path / "empty", shard=0, num_shards=1, read_only=True)


def test_checkpoint_to_an_existing_path_fails(tmp_path: Path) -> None:
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "keep").write_text("mine")
    with Storage(tmp_path / "data", shard=0, num_shards=1) as st, pytest.raises(Exception, match="exists"):
        st.checkpoint(tmp_path / "ck", {})
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["keep"]


def test_copy_checkpoint_restores_rows_and_leaves_the_checkpoint_alone(tmp_path: Path) -> None:
    ck, data = make_checkpoint(tmp_path)
    copy_checkpoint(ck, tmp_path / "restored")
    with Storage(tmp_path / "restored", shard=0, num_shards=1) as st:
        rows = st.table("t", RowFormat(DIM, WIDTH))
        found, rec = rows.get(KEYS)
        assert found.all()
        assert_records(rec, data)
        assert st.specs() == {"t": b"spec"}
        # Writing to the restored copy must not reach the checkpoint (shared SST files
        # are immutable; the rest was copied).
        batch = st.batch()
        rows.delete(batch, KEYS[:4])
        st.commit(batch)
        put_rows(st, rows, KEYS[4:], seed=5)
    with Storage(ck, shard=0, num_shards=1, read_only=True) as ro:
        found, rec = ro.table("t", RowFormat(DIM, WIDTH)).get(KEYS)
        assert found.all()
        assert_records(rec, data)


def test_copy_checkpoint_refuses_a_dir_with_a_db(tmp_path: Path) -> None:
    ck, _ = make_checkpoint(tmp_path)
    with pytest.raises(DataDirError, match="already has a db/"):
        copy_checkpoint(ck, tmp_path / "data")
    # the refused target is untouched and still opens with its own rows
    with Storage(tmp_path / "data", shard=0, num_shards=1) as st:
        assert st.table("t", RowFormat(DIM, WIDTH)).get(KEYS)[0].all()


def test_copy_checkpoint_needs_a_manifest(tmp_path: Path) -> None:
    (tmp_path / "nock" / "db").mkdir(parents=True)
    with pytest.raises(DataDirError, match="manifest.json"):
        copy_checkpoint(tmp_path / "nock", tmp_path / "target")
    assert not (tmp_path / "target" / "db").exists()


# -- ledger: the stored form ------------------------------------------------------------


def applied(ledger: PushLedger, client: str, *seqs: int) -> None:
    for seq in seqs:
        with ledger.claim(client, seq) as fresh:
            assert fresh


def is_fresh(ledger: PushLedger, client: str, seq: int) -> bool:
    class Abandon(Exception):
        pass

    answer = None
    with pytest.raises(Abandon), ledger.claim(client, seq) as fresh:
        answer = fresh
        raise Abandon
    assert answer is not None
    return answer


def test_ledger_encode_decode_load_round_trip() -> None:
    ledger = PushLedger()
    applied(ledger, "w0", 1, 2, 5, 9, 2**63 + 7)
    applied(ledger, "w1", 3)
    assert PushLedger.decode(ledger.encode("w0")) == (2, [(5, 5), (9, 9), (2**63 + 7, 2**63 + 7)])
    assert PushLedger.decode(ledger.encode("w1")) == (0, [(3, 3)])
    assert PushLedger.decode(ledger.encode("never")) == (0, [])

    restored = PushLedger()
    restored.load("w0", ledger.encode("w0"))
    assert restored.encode("w0") == ledger.encode("w0")
    assert [is_fresh(restored, "w0", s) for s in (1, 2, 3, 4, 5, 6, 9, 2**63 + 7)] == [
        False,
        False,
        True,
        True,
        False,
        True,
        False,
        False,
    ]
    with pytest.raises(ValueError, match="empty"):
        PushLedger.decode(b"")


@pytest.mark.parametrize("seq", [1, 2, 3, 4, 6, 100])
def test_ledger_encode_after_equals_encode_after_recording(seq: int) -> None:
    ledger = PushLedger()
    applied(ledger, "w", 1, 3, 4)
    before = ledger.encode("w")
    predicted = ledger.encode_after("w", seq)
    assert ledger.encode("w") == before  # only a prediction
    if is_fresh(ledger, "w", seq):
        applied(ledger, "w", seq)
    assert predicted == ledger.encode("w")


def test_ledger_encode_after_for_a_new_client() -> None:
    ledger = PushLedger()
    predicted = ledger.encode_after("new", 2)
    applied(ledger, "new", 2)
    assert predicted == ledger.encode("new") and PushLedger.decode(predicted) == (0, [(2, 2)])


def test_ledger_reads_the_older_encoding_of_single_seqs() -> None:
    # Data dirs written before ranges: low, then every applied seq above it.
    old = np.array([2, 5, 6, 9], dtype="<u8").tobytes()
    assert PushLedger.decode(old) == (2, [(5, 6), (9, 9)])
    restored = PushLedger()
    restored.load("w", old)
    assert [is_fresh(restored, "w", s) for s in (2, 3, 5, 6, 7, 9, 10)] == [
        False,
        True,
        False,
        False,
        True,
        False,
        True,
    ]
    assert PushLedger.decode(restored.encode("w")) == (2, [(5, 6), (9, 9)])


def test_ledger_gap_costs_one_range_however_many_seqs_follow() -> None:
    ledger = PushLedger()
    applied(ledger, "w", 1, *range(3, 5003))  # seq 2 never came (a push this shard refused)
    low, ranges = PushLedger.decode(ledger.encode("w"))
    assert (low, ranges) == (1, [(3, 5002)]) and len(ledger.encode("w")) == 4 * 8
    applied(ledger, "w", 2)  # the retry fills the gap: one watermark again
    assert PushLedger.decode(ledger.encode("w")) == (5002, [])


def test_ledger_rejects_a_malformed_ranges_entry() -> None:
    with pytest.raises(ValueError, match="pairs"):
        PushLedger.decode(np.array([(1 << 64) - 2, 4, 7], dtype="<u8").tobytes())


def test_ledger_take_changed_and_mark_changed() -> None:
    ledger = PushLedger()
    assert ledger.take_changed() == []
    applied(ledger, "b", 1)
    applied(ledger, "a", 1, 2)
    with ledger.claim("c", 0):  # seq 0 records nothing
        pass
    with ledger.claim("a", 1) as fresh:  # a duplicate changes nothing
        assert not fresh
    assert not is_fresh(ledger, "b", 1) and is_fresh(ledger, "d", 1)  # failed claims change nothing
    assert ledger.take_changed() == ["a", "b"]
    assert ledger.take_changed() == []
    ledger.mark_changed(["b"])
    applied(ledger, "e", 4)
    assert ledger.take_changed() == ["b", "e"]


def _wal_bytes(db: Path) -> int:
    total = 0
    for f in db.glob("*.log"):
        try:
            total += f.stat().st_size
        except FileNotFoundError:  # dropped by a flush between the listing and the stat
            pass
    return total


def test_the_write_ahead_log_stays_bounded_while_the_meta_family_rarely_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every push writes rows to its table's family and a few bytes of ledger to the meta
    # family. A WAL file lives until every family with writes in it has flushed, so
    # without a cap the meta family would keep all of them: a kill -9 then replays them
    # all at the next start (60 s of DLRM pushes: 2.3 GiB, a 5.9 s restart).
    monkeypatch.setattr("ps.store.storage._MAX_WAL_BYTES", 8 << 20)
    keys = np.arange(8192, dtype=np.int64)
    with Storage(tmp_path, shard=0, num_shards=1) as st:
        rows = st.table("t", RowFormat(64, 64))
        for i in range(20):  # 20 x 4 MiB of rows
            batch = st.batch()
            data = random_rows(keys + i * keys.shape[0], 0, 64, 64)
            rows.put(batch, data)
            rows.put_ledger(batch, "client", i.to_bytes(8, "little"))
            st.commit(batch)
        # Past the cap RocksDB flushes in the background and drops the old files once the
        # flush lands, so on a busy machine the figure settles a moment after the last write.
        deadline = time.monotonic() + 15.0
        while (wal := _wal_bytes(tmp_path / "db")) > 24 << 20 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert wal <= 24 << 20, f"{wal >> 20} MiB of WAL kept after 80 MiB written"
    with Storage(tmp_path, shard=0, num_shards=1) as st:  # nothing lost to the early flushes
        found, rec = st.table("t", RowFormat(64, 64)).get(keys + 19 * keys.shape[0])
        assert found.all()
        assert_records(rec, data)
        assert st.table("t", RowFormat(64, 64)).ledgers() == {"client": (19).to_bytes(8, "little")}
