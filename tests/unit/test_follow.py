"""A follower's lag while it resyncs: behind from the first snapshot message until the last;
and the lineage it reports: that of the rows it serves.

Batches are applied straight to ``Source._apply`` (no stream): a restarted leader counts its
versions from 0 again in a new history, so its versions must not be compared with the
follower's old ones.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from protos import ps_pb2 as pb
from protos import wire
from ps.durability import Durability
from ps.replication import Source
from ps.shard import Shard
from ps.store import Storage, precision
from ps.table import TableSpec
from tests.fakes import lookup_rows

DIM = 4


def delta(keys: list[int], value: float) -> pb.TableDelta:
    k = np.array(keys, dtype=np.int64)
    rows = np.full((len(keys), DIM), value, np.float32)
    return pb.TableDelta(table="t", dim=DIM, keys=wire.encode_keys(k), rows=wire.encode_rows(rows))


def spec() -> pb.TableSpec:
    return pb.TableSpec(name="t", dim=DIM)


def test_a_follower_resyncing_to_a_restarted_leader_reports_itself_behind() -> None:
    shard = Shard(0, 1, mode="serve", source=lambda s: Source(s, leader="127.0.0.1:1"))
    source = shard.source  # never started: batches are fed by hand
    assert isinstance(source, Source)
    source._apply(
        pb.FollowBatch(
            history="A",
            version=40,
            leader_version=40,
            specs=[spec()],
            deltas=[delta([1], 1.0)],
            snapshot_begin=True,
            snapshot_end=True,
            in_snapshot=True,
        )
    )
    assert (source.history, source.applied_version, source.status().lag_versions, source.lag_s()) == ("A", 40, 0, 0.0)

    # The leader restarted: history B, versions from 0. Its snapshot comes in two messages.
    source._apply(
        pb.FollowBatch(
            history="B",
            version=3,
            leader_version=3,
            specs=[spec()],
            deltas=[delta([1], 2.0)],
            snapshot_begin=True,
            in_snapshot=True,
        )
    )
    time.sleep(0.01)
    status = source.status()
    assert status.lag_versions >= 1 and status.lag_s > 0, status  # serving history A's rows: behind
    assert source.history == "A" and source.shard.table("t").lookup(np.array([1]))[0, 0] == 1.0

    source._apply(
        pb.FollowBatch(
            history="B",
            version=3,
            leader_version=3,
            specs=[spec()],
            deltas=[delta([2], 2.0)],
            snapshot_end=True,
            in_snapshot=True,
        )
    )
    assert (source.history, source.applied_version, source.status().lag_versions, source.lag_s()) == ("B", 3, 0, 0.0)
    assert source.shard.table("t").lookup(np.array([1, 2]))[:, 0].tolist() == [2.0, 2.0]

    # Then ordinary batches of history B: behind while the leader is ahead, caught up after.
    source._apply(pb.FollowBatch(history="B", version=3, leader_version=5))
    assert source.status().lag_versions == 2 and source.lag_s() >= 0
    source._apply(pb.FollowBatch(history="B", version=5, leader_version=5, specs=[spec()], deltas=[delta([2], 3.0)]))
    assert (source.applied_version, source.status().lag_versions, source.lag_s()) == (5, 0, 0.0)

    # A snapshot of the same history (the follower fell out of the leader's change log): the
    # versions compare, and the lag is the gap to the leader while the snapshot comes in.
    source._apply(
        pb.FollowBatch(
            history="B",
            version=15,
            leader_version=15,
            specs=[spec()],
            deltas=[delta([2], 4.0)],
            snapshot_begin=True,
            in_snapshot=True,
        )
    )
    status = source.status()
    assert (status.applied_version, status.leader_version, status.lag_versions) == (5, 15, 10)
    source._apply(pb.FollowBatch(history="B", version=15, leader_version=15, snapshot_end=True, in_snapshot=True))
    assert (source.applied_version, source.status().lag_versions, source.snapshots) == (15, 0, 3)


def test_a_follower_reports_the_lineage_of_the_rows_it_serves() -> None:
    shard = Shard(0, 1, mode="serve", source=lambda s: Source(s, leader="127.0.0.1:1"))
    source = shard.source
    assert isinstance(source, Source)
    assert source.lineage == "" and source.status().source == "follow"  # nothing loaded yet
    source._apply(
        pb.FollowBatch(
            history="A",
            version=5,
            leader_version=5,
            specs=[spec()],
            deltas=[delta([1], 1.0)],
            snapshot_begin=True,
            snapshot_end=True,
            in_snapshot=True,
            lineage="data-1",
        )
    )
    assert source.lineage == "data-1"
    source._apply(pb.FollowBatch(history="A", version=6, leader_version=6, lineage="data-1"))
    assert source.lineage == "data-1"

    # A leader on other data (its data dir replaced, say): until its snapshot is in, the
    # rows served are still data-1's, and the lineage says so.
    source._apply(
        pb.FollowBatch(
            history="B", version=2, leader_version=2, specs=[spec()], snapshot_begin=True, in_snapshot=True, lineage="2"
        )
    )
    assert source.lineage == "data-1"
    source._apply(
        pb.FollowBatch(history="B", version=2, leader_version=2, snapshot_end=True, in_snapshot=True, lineage="2")
    )
    assert source.lineage == "2" and shard.table("t").export().keys.size == 0  # data-1's rows are gone


def test_a_checkpoint_converted_to_8_bits_serves_within_a_memory_budget(tmp_path: Path) -> None:
    # The converted tables live in RAM alone: the budget has nothing of theirs to evict, and a
    # lookup over it must still answer (it failed with "no storage to evict to").
    training = Shard(0, 1, checkpoint_root=tmp_path)
    training.create_table(TableSpec("a", dim=16))
    keys = np.arange(20_000, dtype=np.int64)
    want = lookup_rows(training, "a", keys)
    path, _ = training.checkpoint(tmp_path / "ck")
    storage = Storage(path, shard=0, num_shards=1, read_only=True)
    served = Shard(
        0,
        1,
        storage,
        Durability("checkpoint-only"),
        200_000,  # a fifth of what the 8-bit rows take
        mode="serve",
        source=lambda s: Source(s, None, serve_dtype="int8"),
    )
    assert served.table("a").spec.storage_dtype == "int8" and served.budget.resident_bytes() > 200_000
    got = lookup_rows(served, "a", keys)
    np.testing.assert_array_equal(got, precision.dequantize(*precision.quantize(want)))
    served.close()
    storage.close()
    training.close()
