"""Live resharding on in-process shards: ``deploy.scale`` driving real ``Shard`` objects
whose new owners pull rows from old owners through ``Shard.move_rows`` (no sockets).

What a reshard must keep: every key on exactly the shard ``shard_of(key, M)`` names, its
row whole (values, optimizer state, last use, use count), every push applied exactly
once per key, also a push that reached one old owner and not another before the move
and is retried after it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from deploy.scale import ScaleError, scale
from protos import ps_pb2 as pb
from protos import wire
from protos.keys import shard_of
from ps.durability import Durability
from ps.elastic import ClusterMap, Route
from ps.errors import InvalidRequest, Moving, ShardMismatch, WrongShard
from ps.replication import ChangeLog
from ps.shard import LookupBatch, Shard
from ps.store import RowFormat, Rows, Storage
from ps.table import OptimizerKind, OptimizerParams, TableSpec
from tests.unit.reshard_cluster import (
    KEYS,
    SGD,
    Cluster,
    all_rows,
    growing_to_three,
    owners_ok,
    push,
    running_cluster,
    seed_rows,
    wait_done,
)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    yield from running_cluster()


def test_growing_moves_only_the_keys_whose_owner_changes_with_their_whole_rows(cluster: Cluster) -> None:
    for i in range(2):
        cluster.add(i, 2)
    seed_rows(cluster, 2)
    before = all_rows(cluster.shards.values(), "a")
    cluster.add(2, 3)
    report = scale(cluster, cluster.addresses(2), cluster.addresses(3))
    wait_done(cluster)

    assert report.src == ClusterMap(0, 2, ("s0", "s1")) and report.dst == ClusterMap(1, 3, ("s0", "s1", "s2"))
    moved = int((shard_of(KEYS, 3) == 2).sum())
    assert report.rows_moved == moved and 0.2 < moved / KEYS.size < 0.45  # about 1/3, and only those
    owners_ok(cluster, 3, "a")
    after = all_rows(cluster.shards.values(), "a")
    for field in ("keys", "values", "state", "last_access", "frequency"):  # bit for bit, every part of a row
        np.testing.assert_array_equal(getattr(after, field).view(np.uint8), getattr(before, field).view(np.uint8))
    for shard in cluster.shards.values():
        assert shard.reshard.map == ClusterMap(1, 3, ("s0", "s1", "s2")) and shard.num_shards == 3
        assert shard.get_map().map.epoch == 1


def test_a_16_bit_table_moves_in_its_stored_type_with_its_versions(cluster: Cluster) -> None:
    spec = TableSpec(
        "h",
        dim=5,
        seed=4,
        optimizer=OptimizerParams(OptimizerKind.ADAGRAD, lr=0.5),
        storage_dtype="bfloat16",
        state_dtype="bfloat16",
    )
    for i in range(2):
        cluster.add(i, 2)
    seed_rows(cluster, 2, spec)
    before = all_rows(cluster.shards.values(), "h")
    cluster.add(2, 3)
    scale(cluster, cluster.addresses(2), cluster.addresses(3))
    wait_done(cluster)
    owners_ok(cluster, 3, "h")
    after = all_rows(cluster.shards.values(), "h")
    assert after.values.dtype == after.state.dtype == np.uint16 and set(after.version.tolist()) == {2}
    for field in ("keys", "values", "state", "version", "last_access", "frequency"):
        np.testing.assert_array_equal(getattr(after, field).view(np.uint8), getattr(before, field).view(np.uint8))


def test_shrinking_hands_the_last_shards_keys_to_the_others_and_retires_them(cluster: Cluster) -> None:
    for i in range(3):
        cluster.add(i, 3)
    seed_rows(cluster, 3)
    before = all_rows(cluster.shards.values(), "a")
    scale(cluster, cluster.addresses(3), cluster.addresses(2))
    wait_done(cluster)
    owners_ok(cluster, 2, "a")
    kept = [cluster.shards["s0"], cluster.shards["s1"]]
    np.testing.assert_array_equal(all_rows(kept, "a").values, before.values)
    assert len(cluster.shards["s2"].table("a").export()) == 0  # dropped after the commit
    with pytest.raises(WrongShard, match="left the cluster") as info:  # a retired shard owns nothing
        cluster.shards["s2"].lookup(
            LookupBatch([("a", KEYS[:3])], Route(3, 2)), lambda dims: [np.empty((3, 3), np.float32)]
        )
    assert info.value.epoch == 1


def test_pushes_while_copying_arrive_and_frozen_moving_keys_wait(cluster: Cluster) -> None:
    new, dst = growing_to_three(cluster)
    # Pushes go on while the rows are copied: the new owner gets the rows as they end up.
    s0 = cluster.shards["s0"]
    mine = KEYS[shard_of(KEYS, 2) == 0]
    for seq in range(3, 8):
        push(s0, "t", mine, np.full((mine.size, 4), 0.25, np.float32), client_id="w", seq=seq)
    moving = mine[shard_of(mine, 3) == 2]
    staying = mine[shard_of(mine, 3) == 0]
    freeze = pb.ReshardRequest(phase=pb.ReshardRequest.FREEZE, to=dst.to_proto())
    cluster.reshard("s0", freeze)
    with pytest.raises(Moving, match="moves from shard 0 to shard 2"):
        push(s0, "t", moving[:2], np.ones((2, 4), np.float32), client_id="w", seq=8)
    push(s0, "t", staying, np.ones((staying.size, 4), np.float32), client_id="v", seq=1)  # the rest go on
    last = s0.table("t").peek_rows(np.sort(moving))[1]  # what the old owner holds once frozen
    unseen = np.arange(10**6, 10**6 + 2000, dtype=np.int64)
    fresh = unseen[(shard_of(unseen, 2) == 0) & (shard_of(unseen, 3) == 2)][:3]
    out = np.empty((3, 4), np.float32)
    s0.lookup(LookupBatch([("t", fresh)], Route(2, 0)), lambda dims: [out])
    assert not np.isin(fresh, s0.table("t").export().keys).any()  # read, not created...
    np.testing.assert_array_equal(out, s0_twin_initial(fresh))  # ...as their initial rows
    cluster.reshard("s1", freeze)
    deadline = time.monotonic() + 20
    while not all(s.complete for s in cluster.reshard("s2", pb.ReshardRequest(to=dst.to_proto())).sources):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    for address in ("s2", "s0", "s1"):
        cluster.reshard(address, pb.ReshardRequest(phase=pb.ReshardRequest.COMMIT, to=dst.to_proto()))
    arrived = new.table("t").peek_rows(np.sort(moving))[1]
    for field in ("keys", "values", "state", "last_access", "frequency"):  # the pushes made while copying came
        np.testing.assert_array_equal(getattr(arrived, field), getattr(last, field))
    with pytest.raises(WrongShard) as info:  # the old owner no longer takes them
        push(s0, "t", moving[:1], np.ones((1, 4), np.float32), client_id="w", seq=9, route=Route(2, 0, 0))
    assert info.value.epoch == 1 and info.value.owner == 2


def erase(shard: Shard, keys: npt.NDArray[np.int64], num_shards: int, epoch: int) -> pb.EraseResponse:
    request = pb.EraseRequest(
        table="t", keys=wire.encode_keys(keys), num_shards=num_shards, shard=shard.index, epoch=epoch
    )
    return shard.erase(request)


def test_an_erase_during_a_move_reaches_the_new_owner(cluster: Cluster) -> None:
    new, dst = growing_to_three(cluster)
    status = pb.ReshardRequest(phase=pb.ReshardRequest.STATUS, to=dst.to_proto())
    deadline = time.monotonic() + 20
    while not all(s.snapshot_done for s in cluster.reshard("s2", status).sources):
        assert time.monotonic() < deadline, "the first copy never arrived"
        time.sleep(0.02)
    s0 = cluster.shards["s0"]
    mine = KEYS[shard_of(KEYS, 2) == 0]
    moving, staying = mine[shard_of(mine, 3) == 2], mine[shard_of(mine, 3) == 0]
    assert new.table("t").holds(moving[:20]) == (20, 0)  # copied already: the erase must follow them
    answer = erase(s0, np.concatenate([moving[:20], staying[:20]]), 2, 0)
    assert answer.erased_ram + answer.erased_disk == 40
    freeze = pb.ReshardRequest(phase=pb.ReshardRequest.FREEZE, to=dst.to_proto())
    cluster.reshard("s0", freeze)
    with pytest.raises(Moving):  # handed over: the client sends it again after the commit
        erase(s0, moving[20:25], 2, 0)
    cluster.reshard("s1", freeze)
    while not all(s.complete for s in cluster.reshard("s2", status).sources):
        assert time.monotonic() < deadline, "the copies never completed"
        time.sleep(0.02)
    for address in ("s2", "s0", "s1"):
        cluster.reshard(address, pb.ReshardRequest(phase=pb.ReshardRequest.COMMIT, to=dst.to_proto()))
    assert new.table("t").holds(moving[:20]) == (0, 0)
    assert s0.table("t").holds(staying[:20]) == (0, 0)
    answer = erase(new, moving[20:25], 3, 1)  # sent again, to the new owner
    assert answer.erased_ram + answer.erased_disk == 5
    wait_done(cluster)
    held = all_rows(cluster.shards.values(), "t").keys
    assert not np.isin(np.concatenate([moving[:25], staying[:20]]), held).any()
    assert held.shape[0] == KEYS.shape[0] - 45
    owners_ok(cluster, 3, "t")


def test_an_erase_sent_to_every_shard_during_a_copy_deletes_no_row_another_shard_is_moving(cluster: Cluster) -> None:
    # Every shard is sent every key of an erase (the others for its checkpoints). A key of s1
    # moving to s2: s1 erases it, a push makes it again, and s2 gets the new row; s0's part of
    # the erase comes late. It must not delete that row there: not from its own table (a row
    # it never had), and not through its copy stream to s2 as a deletion of the key.
    new, dst = growing_to_three(cluster)
    s0, s1 = cluster.shards["s0"], cluster.shards["s1"]
    key = KEYS[(shard_of(KEYS, 2) == 1) & (shard_of(KEYS, 3) == 2)][:1]
    s1.erase(pb.EraseRequest(table="t", keys=wire.encode_keys(key), num_shards=2, shard=1, epoch=0))
    push(s1, "t", key, np.full((1, 4), 0.5, np.float32), client_id="w", seq=50)  # the key trained again
    want = s1.table("t").peek_rows(key)[1].values.copy()
    deadline = time.monotonic() + 20
    while not (
        new.table("t").peek_rows(key)[0].all() and np.array_equal(new.table("t").peek_rows(key)[1].values, want)
    ):
        assert time.monotonic() < deadline, "the new row never reached the new owner"
        time.sleep(0.02)
    late = pb.EraseRequest(table="t", others=wire.encode_keys(key), num_shards=2, shard=0, epoch=0)
    s0.erase(late)
    freeze = pb.ReshardRequest(phase=pb.ReshardRequest.FREEZE, to=dst.to_proto())
    for address in ("s0", "s1"):
        cluster.reshard(address, freeze)
    status = pb.ReshardRequest(phase=pb.ReshardRequest.STATUS, to=dst.to_proto())
    while not all(s.complete for s in cluster.reshard("s2", status).sources):
        assert time.monotonic() < deadline, "the copies never completed"
        time.sleep(0.02)
    for address in ("s2", "s0", "s1"):
        cluster.reshard(address, pb.ReshardRequest(phase=pb.ReshardRequest.COMMIT, to=dst.to_proto()))
    wait_done(cluster)
    found, rows = new.table("t").peek_rows(key)
    assert found.all(), "the row made after the erase was deleted at its new owner"
    np.testing.assert_array_equal(rows.values, want)


def s0_twin_initial(keys: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
    """The initial rows of ``keys`` in table ``t``: what a lookup that creates them returns."""
    twin = Shard(0, 1)
    twin.create_table(SGD)
    out = np.empty((keys.size, SGD.dim), np.float32)
    twin.lookup(LookupBatch([("t", keys)]), lambda dims: [out])
    return out


def test_a_push_applied_on_one_old_owner_and_retried_after_the_move_is_applied_once_per_key(cluster: Cluster) -> None:
    # The case the issue names: push P reached shard 0 and failed on shard 1; the cluster
    # grows; P is retried, routed by the new map. Merging the old owners' ledgers would
    # drop P's part that failed. Push Q reached both, but shard 1's answer was lost.
    for i in range(2):
        cluster.add(i, 2)
    for shard in cluster.shards.values():
        shard.create_table(SGD)
    owners2 = shard_of(KEYS, 2)
    twin = Shard(0, 1)
    twin.create_table(SGD)
    ones = np.ones((KEYS.size, 4), np.float32)

    def part(old: int) -> npt.NDArray[np.bool_]:
        return owners2 == old

    # P (seq 1): shard 0 applies its part, shard 1's is lost before it arrives.
    push(cluster.shards["s0"], "t", KEYS[part(0)], ones[part(0)], client_id="c", seq=1, route=Route(2, 0))
    # Q (seq 2): both apply.
    for old in (0, 1):
        push(
            cluster.shards[f"s{old}"],
            "t",
            KEYS[part(old)],
            2 * ones[part(old)],
            client_id="c",
            seq=2,
            route=Route(2, old),
        )
    # The same pushes, applied once each, in the order each key got them (float sums depend on it).
    push(twin, "t", KEYS[part(0)], ones[part(0)])
    push(twin, "t", KEYS, 2 * ones)
    push(twin, "t", KEYS[part(1)], ones[part(1)])

    cluster.add(2, 3)
    scale(cluster, cluster.addresses(2), cluster.addresses(3))
    wait_done(cluster)
    owners3 = shard_of(KEYS, 3)

    # Retries of both, routed by the new map, each part saying where it was planned.
    for seq, scale_by in ((1, 1.0), (2, 2.0)):
        for old in (0, 1):
            for new in range(3):
                picked = part(old) & (owners3 == new)
                push(
                    cluster.shards[f"s{new}"],
                    "t",
                    KEYS[picked],
                    scale_by * ones[picked],
                    client_id="c",
                    seq=seq,
                    route=Route(3, new, 1),
                    planned_epoch=0,
                    planned_shard=old,
                )
    # And a push after the move, planned by the new map.
    for new in range(3):
        push(
            cluster.shards[f"s{new}"],
            "t",
            KEYS[owners3 == new],
            4 * ones[owners3 == new],
            client_id="c",
            seq=3,
            route=Route(3, new, 1),
        )
    push(twin, "t", KEYS, 4 * ones)

    got = all_rows(cluster.shards.values(), "t")
    want = twin.table("t").export()
    want = want[np.argsort(want.keys, kind="stable")]
    np.testing.assert_array_equal(got.keys, want.keys)
    np.testing.assert_array_equal(got.values, want.values)  # each key got P, Q and the third push once
    # Every client's pushes from before the move are settled: the records merge back.
    # (Nothing left pending is not yet merged: the settle thread merges within its next round.)
    deadline = time.monotonic() + 20
    while any(s.table("t").ledgers.active for s in cluster.shards.values()):
        assert time.monotonic() < deadline, "the push ledgers kept apart never merged back"
        time.sleep(0.05)
    assert sum(s.reshard.pending_ledgers() for s in cluster.shards.values()) == 0


@pytest.mark.parametrize("copy_done", [False, True], ids=["mid-copy", "frozen-copy-done"])
def test_a_reshard_survives_restarts_of_its_shards(cluster: Cluster, tmp_path: Path, copy_done: bool) -> None:
    def open_shard(i: int, n: int) -> Shard:
        storage = Storage(tmp_path / f"s{i}", shard=i, num_shards=n)
        return cluster.add(i, n, storage, durability=Durability("every-push"))

    for i in range(2):
        open_shard(i, 2)
    seed_rows(cluster, 2)
    before = all_rows(cluster.shards.values(), "a")
    open_shard(2, 3)
    src, dst = ClusterMap(0, 2, ("s0", "s1")), ClusterMap(1, 3, ("s0", "s1", "s2"))
    prepare = pb.ReshardRequest(phase=pb.ReshardRequest.PREPARE, to=dst.to_proto(), **{"from": src.to_proto()})
    for address in cluster.addresses(3):
        cluster.reshard(address, prepare)
    cluster.reshard("s0", pb.ReshardRequest(phase=pb.ReshardRequest.FREEZE, to=dst.to_proto()))
    if copy_done:  # the new owner took all of frozen s0's rows and recorded so before it stopped
        deadline = time.monotonic() + 20
        while not next(
            s
            for s in cluster.reshard("s2", pb.ReshardRequest(phase=pb.ReshardRequest.STATUS, to=dst.to_proto())).sources
            if s.shard == 0
        ).complete:
            assert time.monotonic() < deadline, "the copy from the frozen shard never completed"
            time.sleep(0.02)
    # Every shard stops and comes back on its data dir, started with the flags it first had.
    for i, n in ((0, 2), (1, 2), (2, 3)):
        cluster.shards[f"s{i}"].shutdown()
        open_shard(i, n)
    assert cluster.shards["s0"].reshard.frozen  # still refusing pushes to its moving keys
    report = scale(cluster, cluster.addresses(2), cluster.addresses(3))  # carries on from where it was
    wait_done(cluster)
    assert report.dst.epoch == 1
    owners_ok(cluster, 3, "a")
    np.testing.assert_array_equal(all_rows(cluster.shards.values(), "a").values, before.values)
    for i in range(3):  # and once more: each data dir now holds the new map
        cluster.shards[f"s{i}"].shutdown()
        shard = open_shard(i, 2 if i < 2 else 3)
        assert shard.num_shards == 3 and shard.reshard.map.epoch == 1 and shard.reshard.move.phase == "done"
    assert scale(cluster, cluster.addresses(2), cluster.addresses(3)).already_done


def test_scale_refuses_what_it_cannot_do(cluster: Cluster) -> None:
    for i in range(2):
        cluster.add(i, 2)
    cluster.add(2, 4)  # started for another map
    with pytest.raises(ScaleError, match="keep their places"):
        scale(cluster, ["s0", "s1"], ["s1", "s0", "s2"])
    with pytest.raises(ScaleError, match="nothing to reshard"):
        scale(cluster, ["s0", "s1"], ["s0", "s1"])
    with pytest.raises(ScaleError, match="--shard 2 --num-shards 3"):
        scale(cluster, ["s0", "s1"], ["s0", "s1", "s2"])


def test_abort_before_the_commit_leaves_the_cluster_as_it_was(cluster: Cluster) -> None:
    for i in range(2):
        cluster.add(i, 2)
    seed_rows(cluster, 2)
    before = all_rows(cluster.shards.values(), "a")
    cluster.add(2, 3)
    src, dst = ClusterMap(0, 2, ("s0", "s1")), ClusterMap(1, 3, ("s0", "s1", "s2"))
    prepare = pb.ReshardRequest(phase=pb.ReshardRequest.PREPARE, to=dst.to_proto(), **{"from": src.to_proto()})
    for address in cluster.addresses(3):
        cluster.reshard(address, prepare)
    cluster.reshard("s0", pb.ReshardRequest(phase=pb.ReshardRequest.FREEZE, to=dst.to_proto()))
    assert scale(cluster, cluster.addresses(2), cluster.addresses(3), abort=True).aborted
    assert all(s.reshard.move is None and s.reshard.map.epoch == 0 for s in cluster.shards.values())
    assert len(cluster.shards["s2"].table("a").export()) == 0
    np.testing.assert_array_equal(all_rows([cluster.shards["s0"], cluster.shards["s1"]], "a").values, before.values)
    push(cluster.shards["s0"], "a", KEYS[shard_of(KEYS, 2) == 0][:2], np.ones((2, 3), np.float32))  # not frozen


@pytest.mark.parametrize("typed", [("s0", "s1", "s2"), ("s0", "s1", "s3")])
def test_abort_succeeds_without_the_lost_new_shard_and_never_leaves_one_frozen(
    cluster: Cluster, typed: tuple[str, ...]
) -> None:
    for i in range(2):
        cluster.add(i, 2)
    seed_rows(cluster, 2)
    cluster.add(2, 3)
    src, dst = ClusterMap(0, 2, ("s0", "s1")), ClusterMap(1, 3, ("s0", "s1", "s2"))
    prepare = pb.ReshardRequest(phase=pb.ReshardRequest.PREPARE, to=dst.to_proto(), **{"from": src.to_proto()})
    for address in cluster.addresses(3):
        cluster.reshard(address, prepare)
    for address in ("s0", "s1"):
        cluster.reshard(address, pb.ReshardRequest(phase=pb.ReshardRequest.FREEZE, to=dst.to_proto()))
    cluster.shards.pop("s2").shutdown()  # the new shard is lost with its disk
    if "s3" in typed:  # the operator typed the address of a replacement, started empty for place 2
        cluster.shards["s3"] = Shard(2, 3)
    said: list[str] = []
    report = scale(cluster, ["s0", "s1"], list(typed), abort=True, say=said.append)
    assert report.aborted
    assert all(cluster.shards[a].reshard.move is None and not cluster.shards[a].reshard.frozen for a in ("s0", "s1"))
    push(cluster.shards["s0"], "a", KEYS[shard_of(KEYS, 2) == 0][:2], np.ones((2, 3), np.float32))  # not frozen
    assert any("s2" in line and "could not be reached" in line for line in said), said


def test_abort_with_nothing_to_abort_says_so(cluster: Cluster) -> None:
    for i in range(2):
        cluster.add(i, 2)
    cluster.add(2, 3)
    with pytest.raises(ScaleError, match="nothing to abort"):
        scale(cluster, cluster.addresses(2), cluster.addresses(3), abort=True)


def test_a_new_owner_that_reaches_another_shard_at_an_old_owners_address_fails_the_scale_fast(
    cluster: Cluster,
) -> None:
    # As on another host, where 127.0.0.1:PORT typed for shard 0 reaches the new shard itself.
    for i in range(2):
        cluster.add(i, 2)
    seed_rows(cluster, 2)
    cluster.add(2, 3)
    cluster.reaches["s0"] = 2
    with pytest.raises(ScaleError, match="s0, the address of shard 0, reaches shard 2 from shard 2's host") as info:
        scale(cluster, cluster.addresses(2), cluster.addresses(3))
    assert "the reshard was undone: the cluster stays at epoch 0" in str(info.value)
    assert all(s.reshard.move is None and s.reshard.map.epoch == 0 for s in cluster.shards.values())
    push(cluster.shards["s0"], "a", KEYS[shard_of(KEYS, 2) == 0][:2], np.ones((2, 3), np.float32))  # takes pushes


def send_like_a_client(cluster: Cluster, seq: int, grads: npt.NDArray[np.float32]) -> None:
    """One push of ``grads`` to every key, as a client sends it: planned by the map it
    knows; a part refused for now (``Moving``) is sent again; a part refused as routed by
    an old map (``WrongShard``) is routed again by the new one, saying where it was planned."""
    m = cluster.shards["s0"].reshard.map
    parts = [(m.epoch, m.num_shards, s, shard_of(KEYS, m.num_shards) == s) for s in range(m.num_shards)]
    for planned_epoch, n, planned_shard, picked in parts:
        todo = [(Route(n, planned_shard, planned_epoch), picked)]
        while todo:
            route, keys = todo.pop()
            try:
                push(
                    cluster.shards[f"s{route.shard}"],
                    "t",
                    KEYS[keys],
                    grads[keys],
                    client_id="p",
                    seq=seq,
                    route=route,
                    planned_epoch=planned_epoch,
                    planned_shard=planned_shard,
                )
            except Moving:
                time.sleep(0.005)
                todo.append((route, keys))
            except WrongShard as exc:
                now = cluster.shards[f"s{exc.owner}"].reshard.map
                owners = shard_of(KEYS, now.num_shards)
                todo += [(Route(now.num_shards, s, now.epoch), keys & (owners == s)) for s in range(now.num_shards)]


def test_concurrent_pushes_during_a_whole_scale_are_each_applied_once(cluster: Cluster) -> None:
    for i in range(2):
        cluster.add(i, 2)
    for shard in cluster.shards.values():
        shard.create_table(SGD)
    twin = Shard(0, 1)
    twin.create_table(SGD)
    cluster.add(2, 3)
    stop = threading.Event()
    sent: list[int] = []
    grads = np.full((KEYS.size, 4), 0.125, np.float32)

    def pusher() -> None:
        while not stop.is_set():
            send_like_a_client(cluster, len(sent) + 1, grads)
            sent.append(len(sent) + 1)

    thread = threading.Thread(target=pusher)
    thread.start()
    while len(sent) < 2:  # every key has a row before the move starts
        time.sleep(0.01)
    report = scale(cluster, cluster.addresses(2), cluster.addresses(3))
    time.sleep(0.2)
    stop.set()
    thread.join(30)
    wait_done(cluster)
    for seq in sent:
        push(twin, "t", KEYS, grads, client_id="p", seq=seq)
    assert len(sent) > 5
    # Rows moved: each moving row once, however often the pushes changed it during the copy
    # (the changes sent after the first copy are counted apart).
    assert report.rows_moved == int((shard_of(KEYS, 3) == 2).sum()), (report.rows_moved, report.rows_sent)
    assert report.rows_sent >= report.rows_moved + report.rows_changed
    owners_ok(cluster, 3, "t")
    np.testing.assert_array_equal(all_rows(cluster.shards.values(), "t").values, all_rows([twin], "t").values)


def test_a_push_frozen_out_of_both_old_owners_reaches_the_new_one_in_two_parts_and_both_apply(
    cluster: Cluster,
) -> None:
    # Push R, planned by the old map, is refused by both old owners while frozen (its parts
    # hold moving keys). After the commit each part is routed again: the keys that moved
    # reach the new owner as two requests, one per old owner, with the same seq. Both must
    # apply: R was applied to none of their keys.
    for i in range(2):
        cluster.add(i, 2)
    for shard in cluster.shards.values():
        shard.create_table(SGD)
    new = cluster.add(2, 3)
    start = np.empty((KEYS.size, 4), np.float32)
    scale(cluster, cluster.addresses(2), cluster.addresses(3))
    wait_done(cluster)
    owners2, owners3 = shard_of(KEYS, 2), shard_of(KEYS, 3)
    moved = owners3 == 2
    new.lookup(LookupBatch([("t", KEYS[moved])], Route(3, 2, 1)), lambda dims: [start[: int(moved.sum())]])
    for old in (0, 1):
        part = moved & (owners2 == old)
        push(
            new,
            "t",
            KEYS[part],
            np.ones((int(part.sum()), 4), np.float32),
            client_id="r",
            seq=1,
            route=Route(3, 2, 1),
            planned_epoch=0,
            planned_shard=old,
        )
    after = np.empty_like(start[: int(moved.sum())])
    new.lookup(LookupBatch([("t", KEYS[moved])], Route(3, 2, 1)), lambda dims: [after])
    np.testing.assert_array_equal(after, start[: int(moved.sum())] - np.float32(1.0))
    # Sent again (a retry of either part): applied before, nothing changes.
    part = moved & (owners2 == 1)
    push(
        new,
        "t",
        KEYS[part],
        np.ones((int(part.sum()), 4), np.float32),
        client_id="r",
        seq=1,
        route=Route(3, 2, 1),
        planned_epoch=0,
        planned_shard=1,
    )
    new.lookup(LookupBatch([("t", KEYS[moved])], Route(3, 2, 1)), lambda dims: [after])
    np.testing.assert_array_equal(after, start[: int(moved.sum())] - np.float32(1.0))


def test_a_follower_started_for_any_size_its_shard_had_may_follow_it(cluster: Cluster, tmp_path: Path) -> None:
    """A serving shard restarted with the flags it was first given (2 shards) follows its
    training shard after two reshards (2 -> 3 -> 4); one for a size it never had does not."""
    for i, n in ((0, 2), (1, 2), (2, 3), (3, 4)):
        cluster.add(i, n, Storage(tmp_path / f"s{i}", shard=i, num_shards=n), durability=Durability("every-push"))
    seed_rows(cluster, 2)
    scale(cluster, cluster.addresses(2), cluster.addresses(3))
    wait_done(cluster)
    scale(cluster, cluster.addresses(3), cluster.addresses(4))
    wait_done(cluster)
    shard = cluster.shards["s0"]
    for n in (2, 3, 4):
        next(iter(shard.follow(Route(num_shards=n, shard=0), "", 0, lambda: False, 1 << 20)), None)
    for bad in (Route(num_shards=5, shard=0), Route(num_shards=0, shard=0), Route(num_shards=4, shard=1)):
        with pytest.raises(ShardMismatch):
            next(iter(shard.follow(bad, "", 0, lambda: False, 1 << 20)), None)


def test_a_copy_longer_than_the_change_log_holds_still_ends(cluster: Cluster) -> None:
    """Pushes during a copy that change more keys than the old owner's change log keeps
    (a paced copy of a big table under training) must not send the copy back to its start
    again and again: the old owner drains the log after every message it sends."""
    keys = np.arange(120_000, dtype=np.int64) * 7919
    s0 = cluster.add(0, 2, changes=ChangeLog(max_keys=200))
    s0.create_table(SGD)
    mine = keys[shard_of(keys, 2) == 0]
    push(s0, "t", mine, np.ones((mine.size, 4), np.float32), client_id="w", seq=1)
    moving = np.sort(mine[shard_of(mine, 3) == 2])
    src, dst = ClusterMap(0, 2, ("s0", "s1")), ClusterMap(1, 3, ("s0", "s1", "s2"))
    s0.reshard_request(
        pb.ReshardRequest(phase=pb.ReshardRequest.PREPARE, to=dst.to_proto(), **{"from": src.to_proto()})
    )
    stream = iter(s0.move_rows(dst, 2, lambda: True, 1 << 16))  # messages of ~2,000 rows
    got: dict[int, npt.NDArray[np.float32]] = {}
    rng = np.random.default_rng(5)
    begun = ended = 0
    seq = 1
    for _ in range(200):  # one push of 50 moving keys per message: 50 < 200, yet the copy spans more
        batch = next(stream)
        begun += batch.snapshot_begin
        ended += batch.snapshot_end
        assert begun == 1, "the copy started over"
        for moved in batch.tables:
            rows = Rows.unpack(wire.decode_keys(moved.keys, "keys"), moved.rows, RowFormat(4, 0))
            got.update(zip(rows.keys.tolist(), rows.values))
        if ended and not batch.tables and batch.version > 1 and not batch.snapshot_end:
            break  # caught up with the pushes since the copy began
        seq += 1
        picked = rng.choice(moving, 50, replace=False)
        push(s0, "t", picked, np.ones((50, 4), np.float32), client_id="w", seq=seq)
    assert ended == 1 and seq > 8, f"the copy took {seq - 1} messages: too few for the test to mean anything"
    s0.reshard_request(pb.ReshardRequest(phase=pb.ReshardRequest.FREEZE, to=dst.to_proto()))
    for batch in stream:
        for moved in batch.tables:
            rows = Rows.unpack(wire.decode_keys(moved.keys, "keys"), moved.rows, RowFormat(4, 0))
            got.update(zip(rows.keys.tolist(), rows.values))
        if batch.done:
            break
    _, want = s0.table("t").peek_rows(moving)
    np.testing.assert_array_equal(np.array([got[k] for k in moving.tolist()]), want.values)


@pytest.mark.parametrize("epoch", [0, 2, 2**64 - 1])
def test_rows_asked_for_a_map_that_can_never_be_prepared_are_refused_for_good(cluster: Cluster, epoch: int) -> None:
    s0 = cluster.add(0, 2)
    s0.create_table(SGD)
    to = ClusterMap(epoch, 3, ("s0", "s1", "s2"))
    with pytest.raises(InvalidRequest, match=f"epoch {epoch}.*cannot be prepared on shard 0, which is at epoch 0"):
        next(iter(s0.move_rows(to, 2, lambda: True, 1 << 16)))
    with pytest.raises(Moving, match="retry shortly"):  # the next map may be prepared any moment
        next(iter(s0.move_rows(ClusterMap(1, 3, ("s0", "s1", "s2")), 2, lambda: True, 1 << 16)))
    src, dst = ClusterMap(0, 2, ("s0", "s1")), ClusterMap(1, 3, ("s0", "s1", "s2"))
    s0.reshard_request(
        pb.ReshardRequest(phase=pb.ReshardRequest.PREPARE, to=dst.to_proto(), **{"from": src.to_proto()})
    )
    other = ClusterMap(1, 4, ("s0", "s1", "s2", "s3"))  # the same epoch, another map: never while this one runs
    with pytest.raises(InvalidRequest, match="takes part in the reshard to epoch 1: 3 shards"):
        next(iter(s0.move_rows(other, 2, lambda: True, 1 << 16)))
