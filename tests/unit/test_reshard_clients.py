"""Clients through a live reshard, on in-process shards: ``PSClient`` (as a trainer
uses it) learns the new cluster map from the shards, routes by it, and every push it
made is applied once per key."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from client import ClientConfig, PSClient
from deploy.scale import scale
from protos import ps_pb2 as pb
from protos.keys import shard_of
from ps.elastic import ClusterMap
from ps.shard import Shard
from tests.fakes import InProcessTransport
from tests.unit.reshard_cluster import (
    KEYS,
    SGD,
    Cluster,
    all_rows,
    growing_to_three,
    owners_ok,
    running_cluster,
    wait_done,
)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    yield from running_cluster()


def test_a_client_training_through_a_scale_learns_the_new_map_and_applies_each_push_once(cluster: Cluster) -> None:
    # PSClient as a trainer uses it, during a whole 2 -> 3 scale: refused parts are sent
    # again (frozen keys), routed by the new map (after the commit), and no error reaches
    # the caller.
    for i in range(2):
        cluster.add(i, 2)
    cluster.add(2, 3)
    transport = InProcessTransport(
        [cluster.shards["s0"], cluster.shards["s1"]], by_address=cluster.shards, addresses=["s0", "s1"]
    )
    fast = ClientConfig(backoff_initial_s=0.002, backoff_max_s=0.01, tune_malloc=False)
    with PSClient(["s0", "s1"], fast, transport=transport, client_id="trainer") as ps:
        ps.create_table("t", 4, lr=1.0, seed=7)
        twin = Shard(0, 1)
        twin.create_table(SGD)
        start = ps.lookup("t", KEYS)
        stop = threading.Event()
        steps: list[int] = []

        def train() -> None:
            while not stop.is_set():
                rows = ps.lookup("t", KEYS)
                assert rows.shape == (KEYS.size, 4)
                ps.push("t", KEYS, np.full((KEYS.size, 4), 0.25, np.float32))
                steps.append(1)

        thread = threading.Thread(target=train)
        thread.start()
        time.sleep(0.2)
        scale(cluster, ["s0", "s1"], ["s0", "s1", "s2"])
        time.sleep(0.3)
        stop.set()
        thread.join(30)
        assert not thread.is_alive() and len(steps) > 5
        assert ps.epoch == 1 and ps.num_shards == 3 and ps.addresses == ["s0", "s1", "s2"]
        got = ps.lookup("t", KEYS)
    wait_done(cluster)
    owners_ok(cluster, 3, "t")
    want = start.copy()
    for _ in steps:
        want = want - np.float32(0.25)
    np.testing.assert_array_equal(got, want)


def test_a_client_given_old_addresses_learns_the_map_before_it_routes(cluster: Cluster) -> None:
    for i in range(2):
        cluster.add(i, 2)
    cluster.add(2, 3)
    fast = ClientConfig(backoff_initial_s=0.002, backoff_max_s=0.01, tune_malloc=False)
    first = PSClient(
        ["s0", "s1"],
        fast,
        transport=InProcessTransport(
            [cluster.shards["s0"], cluster.shards["s1"]], by_address=cluster.shards, addresses=["s0", "s1"]
        ),
    )
    first.create_table("t", 4, lr=1.0, seed=7)
    rows = first.lookup("t", KEYS)
    scale(cluster, ["s0", "s1"], ["s0", "s1", "s2"])
    transport = InProcessTransport(
        [cluster.shards["s0"], cluster.shards["s1"]], by_address=cluster.shards, addresses=["s0", "s1"]
    )
    late = PSClient(["s0", "s1"], fast, transport=transport)
    np.testing.assert_array_equal(late.lookup("t", KEYS), rows)
    assert late.epoch == 1 and late.num_shards == 3
    assert [m for _, m, _ in transport.calls] == ["ListTables", "GetMap"]  # asked first: nothing refused


def test_a_trainer_through_grow_shrink_grow_applies_each_push_once_and_ledgers_settle(cluster: Cluster) -> None:
    # A client started after the cluster grew and shrank back (epoch 2, the size it was
    # given) trains through another grow and shrink; a shard that left and rejoins is empty.
    for i in range(2):
        cluster.add(i, 2)
    cluster.add(2, 3)
    fast = ClientConfig(backoff_initial_s=0.002, backoff_max_s=0.01, tune_malloc=False)

    def client(client_id: str | None = None) -> PSClient:
        transport = InProcessTransport(
            [cluster.shards["s0"], cluster.shards["s1"]], by_address=cluster.shards, addresses=["s0", "s1"]
        )
        return PSClient(["s0", "s1"], fast, transport=transport, client_id=client_id).start()

    admin = client()
    admin.create_table("t", 4, lr=1.0, seed=7)
    scale(cluster, ["s0", "s1"], ["s0", "s1", "s2"])
    scale(cluster, ["s0", "s1", "s2"], ["s0", "s1"], timeout_s=30)
    trainer = client("trainer")
    start = trainer.lookup("t", KEYS)
    stop, steps, errors = threading.Event(), [0], []

    def train() -> None:
        try:
            while not stop.is_set():
                trainer.push("t", KEYS, np.full((KEYS.size, 4), 0.25, np.float32))
                steps[0] += 1
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=train)
    thread.start()
    time.sleep(0.1)
    scale(cluster, ["s0", "s1"], ["s0", "s1", "s2"], timeout_s=30)
    scale(cluster, ["s0", "s1", "s2"], ["s0", "s1"], timeout_s=30)  # waits for the ledgers to settle first
    time.sleep(0.1)
    stop.set()
    thread.join(30)
    assert errors == [] and steps[0] > 3
    want = start.copy()
    for _ in range(steps[0]):
        want = want - np.float32(0.25)
    np.testing.assert_array_equal(trainer.lookup("t", KEYS), want)


def test_a_lone_serving_replica_behind_the_map_is_asked_again_until_it_switches() -> None:
    # A serving map switch reaches replicas one at a time: a client that learned the new map
    # from a switched one may reach the sole replica of another shard before its switch.
    # That replica answers BehindMap; the client asks it again (no other replica to ask)
    # until it switches, within the call's deadline.
    serving = {f"r{i}": Shard(i, 2 if i < 2 else 3, mode="serve") for i in range(3)}
    for shard in serving.values():
        shard.install_table(SGD)
    switch = pb.ReshardRequest(phase=pb.ReshardRequest.COMMIT, to=ClusterMap(1, 3, ("r0", "r1", "r2")).to_proto())
    for address in ("r2", "r1"):  # new ones first, then down the shards: shard 0 is about to switch
        serving[address].reshard_request(switch)
    transport = InProcessTransport([serving["r0"], serving["r1"]], by_address=serving, addresses=["r0", "r1"])
    fast = ClientConfig(backoff_initial_s=0.002, backoff_max_s=0.01, deadline_s=10.0, tune_malloc=False)
    with PSClient(["r0", "r1"], fast, transport=transport) as reader:
        later = threading.Timer(0.3, serving["r0"].reshard_request, [switch])
        later.start()
        rows = reader.lookup("t", KEYS)  # shard 1 refuses the keys that moved: the client learns epoch 1
        later.join()
        assert reader.epoch == 1
    np.testing.assert_array_equal(rows, np.zeros((KEYS.size, 4), np.float32))  # serving defaults, from every shard


def test_an_admin_erase_during_the_hand_over_waits_for_the_commit_and_reaches_the_new_owner(cluster: Cluster) -> None:
    # ps-admin sends each call once (max_attempts=1). An erase of keys whose old owner is
    # frozen is refused before anything is erased; that refusal uses up no attempt, so the
    # erase waits out the hand-over and, after the commit, goes to the keys' new owner.
    new, dst = growing_to_three(cluster)
    status = pb.ReshardRequest(phase=pb.ReshardRequest.STATUS, to=dst.to_proto())
    freeze = pb.ReshardRequest(phase=pb.ReshardRequest.FREEZE, to=dst.to_proto())
    deadline = time.monotonic() + 20
    while not all(s.snapshot_done for s in cluster.reshard("s2", status).sources):
        assert time.monotonic() < deadline, "the first copy never arrived"
        time.sleep(0.02)
    for address in ("s0", "s1"):
        cluster.reshard(address, freeze)
    moving = KEYS[(shard_of(KEYS, 2) != shard_of(KEYS, 3))][:30]
    staying = KEYS[(shard_of(KEYS, 2) == shard_of(KEYS, 3))][:30]
    transport = InProcessTransport(
        [cluster.shards["s0"], cluster.shards["s1"]], by_address=cluster.shards, addresses=["s0", "s1"]
    )
    once = ClientConfig(max_attempts=1, backoff_initial_s=0.002, backoff_max_s=0.02, tune_malloc=False)
    answers: list[list[dict[str, object]]] = []
    errors: list[BaseException] = []

    def erase() -> None:
        with PSClient(["s0", "s1"], once, transport=transport) as admin:
            try:
                answers.append(admin.admin.erase("t", np.concatenate([moving, staying])))
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                errors.append(exc)

    thread = threading.Thread(target=erase)
    thread.start()
    while sum(1 for _, m, _ in transport.calls if m == "Erase") < 4:  # refused, and sent again
        assert thread.is_alive(), errors
        assert time.monotonic() < deadline, "the erase was not sent"
        time.sleep(0.01)
    both = np.concatenate([moving, staying])
    for i in range(2):  # refused before anything was erased: each old owner holds every row of its keys
        mine = both[shard_of(both, 2) == i]
        assert sum(cluster.shards[f"s{i}"].table("t").holds(mine)) == mine.size
    while not all(s.complete for s in cluster.reshard("s2", status).sources):
        assert time.monotonic() < deadline, "the copies never completed"
        time.sleep(0.02)
    for address in ("s2", "s0", "s1"):
        cluster.reshard(address, pb.ReshardRequest(phase=pb.ReshardRequest.COMMIT, to=dst.to_proto()))
    thread.join(30)
    assert not thread.is_alive() and errors == []
    (answer,) = answers
    # Each key's row at its new owner; an old owner that has not dropped the rows it gave away
    # yet erases its copy too, and counts it.
    assert len(answer) == 3 and sum(int(a["erased_ram"]) + int(a["erased_disk"]) for a in answer) >= 60
    wait_done(cluster)
    held = all_rows(cluster.shards.values(), "t").keys
    assert not np.isin(np.concatenate([moving, staying]), held).any()
    assert new.table("t").holds(moving[shard_of(moving, 3) == 2]) == (0, 0)


def test_a_verify_from_a_client_behind_the_map_asks_every_shard_of_the_new_one(cluster: Cluster) -> None:
    # What ps-admin erase --verify does with the addresses of before a grow: the shards refuse
    # keys under the newer map; the verify is asked again of all three, each place once.
    for i in range(2):
        cluster.add(i, 2)
    cluster.add(2, 3)
    fast = ClientConfig(max_attempts=1, backoff_initial_s=0.002, backoff_max_s=0.01, tune_malloc=False)
    transport = InProcessTransport(
        [cluster.shards["s0"], cluster.shards["s1"]], by_address=cluster.shards, addresses=["s0", "s1"]
    )
    with PSClient(["s0", "s1"], fast, transport=transport) as client:
        client.create_table("t", 4, lr=1.0, seed=7)
        client.lookup("t", KEYS)  # every key has a row
        scale(cluster, ["s0", "s1"], ["s0", "s1", "s2"])
        wait_done(cluster)
        found = client.admin.find_erased("t", KEYS[:300])
    assert [f["address"] for f in found] == ["s0", "s1", "s2"]
    assert [int(f["erased_ram"]) + int(f["erased_disk"]) for f in found] == [
        int((shard_of(KEYS[:300], 3) == i).sum()) for i in range(3)
    ]
