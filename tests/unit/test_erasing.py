"""Erasing rows on one shard (``ps.shard.erasing``), in process on a real data dir: the
rescue dumps of the data dir are rewritten without the rows, and an erase a stop cut
short (its journal entry written, the work not done) is completed by the next start,
from the data dir and every checkpoint, before the shard serves.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from protos import ps_pb2 as pb
from protos import wire
from ps.durability import (
    Durability,
    erase_data_done,
    find_in_checkpoints,
    find_in_dumps,
    journal_erase,
    pending_erasures,
)
from ps.shard import Shard
from ps.store import Storage
from ps.table import InitializerKind, InitializerParams, OptimizerKind, OptimizerParams, TableSpec
from tests.fakes import push_request
from tests.unit.test_rescue import Blocker, refuse_writes

SPEC = TableSpec(
    "t", 4, initializer=InitializerParams(InitializerKind.ZEROS), optimizer=OptimizerParams(OptimizerKind.SGD, lr=1.0)
)
KEYS = np.arange(100, dtype=np.int64)


def open_shard(data_dir: Path) -> Shard:
    shard = Shard(0, 1, Storage(data_dir, shard=0, num_shards=1), Durability.parse("interval:60"))
    shard.start()
    return shard


def push(shard: Shard, seq: int, keys: npt.NDArray[np.int64] = KEYS) -> None:
    grads = -np.full((keys.shape[0], 4), seq, np.float32)
    assert shard.push(push_request([("t", keys, grads)], "w", seq))[0]


def erase(shard: Shard, keys: npt.NDArray[np.int64], **flags: bool) -> pb.EraseResponse:
    return shard.erase(pb.EraseRequest(table="t", keys=wire.encode_keys(keys), num_shards=1, shard=0, **flags))


def test_an_erase_rewrites_the_rescue_dumps_of_the_data_dir(tmp_path: Path) -> None:
    shard = open_shard(tmp_path / "data")
    shard.create_table(SPEC)
    push(shard, 1)
    shard.flush()
    push(shard, 2, KEYS[:30])  # acknowledged, only in RAM: what a stop on a refusing disk dumps
    refuse_writes(shard.storage)  # type: ignore[arg-type]
    blocker = Blocker(tmp_path / "data")
    report = shard.shutdown(grace_s=0.3)
    blocker.release()
    dump = report.rescue_path
    assert dump is not None and (dump / "0.keys").is_file()
    row_bytes = {int(k): np.array([3, 3, 3, 3], np.float32).tobytes() for k in KEYS[:30]}  # each dumped row: 1 + 2
    assert all(v in (dump / "0.rows").read_bytes() for v in row_bytes.values())

    shard = open_shard(tmp_path / "data")  # applies the dump at its start
    try:
        erased = KEYS[:10]
        answer = erase(shard, erased, checkpoints=True, compact=True)
        assert answer.erased_ram + answer.erased_disk == 10
        assert [(Path(c.path), c.rows) for c in answer.checkpoints] == [(dump, 10)]
        manifest = json.loads((dump / "manifest.json").read_text())
        (entry,) = manifest["tables"]
        assert entry["rows"] == 20 and entry["files"] == {"keys": "0.g1.keys", "rows": "0.g1.rows"}
        assert sorted(p.name for p in dump.iterdir()) == ["0.g1.keys", "0.g1.rows", "manifest.json"]
        kept = np.fromfile(dump / "0.g1.keys", dtype="<i8")
        np.testing.assert_array_equal(np.sort(kept), KEYS[10:30])
        assert find_in_dumps(shard.storage, shard.erasing._p.dump_places, "t", erased) == [(dump, 0)]  # type: ignore[arg-type]
        verified = erase(shard, erased, checkpoints=True, verify=True)
        assert (verified.erased_ram, verified.erased_disk, [c.rows for c in verified.checkpoints]) == (0, 0, [0])
        # A second erase of other keys rewrites the rewritten files (generation 2).
        assert [c.rows for c in erase(shard, KEYS[25:40], checkpoints=True).checkpoints] == [5]
        assert sorted(p.name for p in dump.iterdir()) == ["0.g2.keys", "0.g2.rows", "manifest.json"]
    finally:
        shard.shutdown()


@pytest.mark.parametrize("held_in", ["ram", "disk"])
def test_an_erase_cut_short_is_completed_at_the_next_start(tmp_path: Path, held_in: str) -> None:
    shard = open_shard(tmp_path / "data")
    shard.create_table(SPEC)
    push(shard, 1)
    shard.checkpoint("before")
    if held_in == "disk":
        shard.flush()
        shard.table("t").evict(100)
    erased = KEYS[::3]
    assert shard.storage is not None
    # What a shard killed right after it journaled the erase leaves: the entry, and every row.
    journal_erase(shard.storage, "t", erased, compact=True, checkpoints=True)
    shard.shutdown()

    again = open_shard(tmp_path / "data")
    try:
        assert again.storage is not None and pending_erasures(again.storage) == []
        assert again.table("t").holds(erased) == (0, 0)
        assert again.table("t").holds(np.setdiff1d(KEYS, erased)) in ((66, 0), (0, 66))
        assert [n for _, n in find_in_checkpoints(again.checkpoint_root, "t", erased)] == [0]
        kept = again.table("t").lookup(KEYS[1:2], create=False)
        np.testing.assert_array_equal(kept, [[1, 1, 1, 1]])
        np.testing.assert_array_equal(again.table("t").lookup(erased, create=True), 0)  # new again: initial rows
    finally:
        again.shutdown()


def test_erases_under_concurrent_pushes_leave_every_row_whole(tmp_path: Path) -> None:
    """Pushes of -1 to every key (SGD, lr 1, rows start at 0) run while erases of half the keys
    come and go: a kept row ends at minus the number of pushes; an erased one is absent or
    starts again from 0, so it holds minus the pushes applied after its last erase, the same
    in every column (no push half applied, no erase half done)."""
    shard = open_shard(tmp_path / "data")
    shard.create_table(SPEC)
    erased, kept = KEYS[::2], KEYS[1::2]
    pushes, stop = 300, threading.Event()
    failures: list[BaseException] = []
    erases, erased_more = 0, threading.Condition()

    def erases_reach(count: int) -> bool:
        with erased_more:
            return erased_more.wait_for(lambda: erases >= count, timeout=120)

    def pusher() -> None:
        try:
            for seq in range(1, pushes + 1):
                grads = np.ones((KEYS.shape[0], 4), np.float32)
                assert shard.push(push_request([("t", KEYS, grads)], "w", seq))[0]
                if seq % 50 == 0:
                    shard.flush()
                    shard.table("t").evict(30)  # some rows on disk only, for the erase to find there
                    # Every 50 pushes wait for one more erase, so erases fall between pushes
                    # however the two threads are scheduled on a loaded machine.
                    assert erases_reach(seq // 50)
        except BaseException as exc:  # noqa: BLE001 - the test thread reports it
            failures.append(exc)
        finally:
            stop.set()

    thread = threading.Thread(target=pusher)
    thread.start()
    try:
        while not stop.is_set():
            erase(shard, erased, compact=erases % 5 == 0)
            with erased_more:
                erases += 1
                erased_more.notify_all()
    finally:
        thread.join(60)
    assert not failures, failures
    table = shard.table("t")
    np.testing.assert_array_equal(table.lookup(kept, create=False), -pushes)
    ram, disk = table.holds(erased)
    rows = table.lookup(erased, create=False)
    assert (rows == rows[:, :1]).all(), "a row whose columns differ: a push half applied"
    assert ((rows <= 0) & (rows >= -pushes) & (rows == np.round(rows))).all()
    shard.shutdown()
    again = open_shard(tmp_path / "data")  # and as the data dir holds them
    try:
        np.testing.assert_array_equal(again.table("t").lookup(KEYS, create=False)[1::2], -pushes)
        np.testing.assert_array_equal(again.table("t").lookup(erased, create=False), rows)
        assert sum(again.table("t").holds(erased)) == ram + disk
    finally:
        again.shutdown()


def test_an_erase_sent_again_closes_the_entry_its_failed_try_left(tmp_path: Path) -> None:
    """A try that failed half way leaves its journal entry; the try that then succeeds does
    all of it, so it takes that entry out too (a start would otherwise erase the keys again,
    and rows made since with them). An entry it did not cover stays."""
    shard = open_shard(tmp_path / "data")
    try:
        shard.create_table(SPEC)
        push(shard, 1)
        assert shard.storage is not None
        journal_erase(shard.storage, "t", KEYS[:10], compact=True, checkpoints=True)  # the failed try
        other = journal_erase(shard.storage, "t", KEYS[50:60], compact=True, checkpoints=True)
        erase(shard, KEYS[:20], compact=True, checkpoints=True)
        assert [job.id for job in pending_erasures(shard.storage)] == [other.id]
    finally:
        shard.shutdown()


def test_a_start_does_not_erase_again_rows_made_after_the_data_dir_step(tmp_path: Path) -> None:
    """An entry whose rows left the data dir (its checkpoints not yet rewritten, say) keeps
    to the checkpoints it listed: rows the keys got since are new, and stay."""
    shard = open_shard(tmp_path / "data")
    shard.create_table(SPEC)
    push(shard, 1)
    part, _ = shard.checkpoint("before")
    assert shard.storage is not None
    job = journal_erase(shard.storage, "t", KEYS[:10], compact=True, checkpoints=True, places=[part])
    erase_data_done(shard.storage, job)
    shard.table("t").erase(KEYS[:10])  # what the erase did before the stop
    push(shard, 2, KEYS[:10])  # the keys are new again, and trained on
    shard.checkpoint("after")  # a checkpoint made since holds the new rows
    shard.shutdown()

    again = open_shard(tmp_path / "data")
    try:
        assert again.storage is not None and pending_erasures(again.storage) == []
        np.testing.assert_array_equal(again.table("t").lookup(KEYS[:10], create=False), 2)
        found = {p.parent.name: n for p, n in find_in_checkpoints(again.checkpoint_root, "t", KEYS[:10])}
        assert found == {"before": 0, "after": 10}
    finally:
        again.shutdown()


def test_a_start_completes_an_erase_of_other_shards_keys_in_the_checkpoints_only(tmp_path: Path) -> None:
    """The keys other shards own (``others``) are journaled apart: a start erases them from the
    checkpoints, never from the data dir (a row of such a key there is not this shard's to
    delete)."""
    shard = open_shard(tmp_path / "data")
    shard.create_table(SPEC)
    push(shard, 1)
    shard.checkpoint("before")
    assert shard.storage is not None
    mine, others = KEYS[:10], KEYS[50:60]  # this shard of one holds both: the start must tell them apart
    job = journal_erase(shard.storage, "t", mine, compact=False, checkpoints=True, others=others)
    (read,) = pending_erasures(shard.storage)
    assert read.id == job.id
    np.testing.assert_array_equal(read.keys, mine)
    np.testing.assert_array_equal(read.others, others)
    shard.shutdown()

    again = open_shard(tmp_path / "data")
    try:
        assert again.storage is not None and pending_erasures(again.storage) == []
        assert again.table("t").holds(mine) == (0, 0)
        assert sum(again.table("t").holds(others)) == others.size  # kept in the data dir
        held = np.concatenate([mine, others])
        assert [n for _, n in find_in_checkpoints(again.checkpoint_root, "t", held)] == [0]
    finally:
        again.shutdown()
