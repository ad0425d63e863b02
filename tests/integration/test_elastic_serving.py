"""Serving replicas that join, drain and die while clients look rows up: real processes.

A training cluster of 2 shards holds fixed rows; serving replicas follow it
(``deploy.replicas.ServingReplicas``) and list themselves in an addresses file that a
``PSClient(addresses_file=...)`` follows. Every lookup is compared with the training
shards' rows, so a replica that served something else (not loaded yet, half a snapshot)
fails the test as surely as a call that raised.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import numpy.typing as npt
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import ClientConfig, PSClient
from deploy.local import LocalCluster, ShardProcess, start_shard
from deploy.replicas import ServingReplicas
from tests.faults.proxy import FaultProxy
from tests.integration.test_admin import ok, ps_admin

KEYS = np.arange(0, 4000, dtype=np.int64)
F32 = npt.NDArray[np.float32]


@pytest.fixture(scope="module")
def training(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, F32]]:
    """Two training shards holding a table whose rows do not change, and those rows."""
    with LocalCluster(2, root=tmp_path_factory.mktemp("training")) as cluster:
        with PSClient(cluster.addresses) as client:
            client.create_table("t", 8, initializer="normal", seed=3)
            client.lookup("t", KEYS)
            client.push("t", KEYS, np.ones((KEYS.shape[0], 8), np.float32))
            rows = client.lookup("t", KEYS)
        yield cluster, rows


def health(address: str) -> str:
    """The server's overall health status name, or the gRPC code name if it did not answer."""
    with grpc.insecure_channel(address) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        except grpc.RpcError as exc:
            return str(exc.code().name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))


def until(what: Callable[[], bool], about: Callable[[], object], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, about()
        time.sleep(0.05)


class Lookups:
    """Lookups of every key in a loop on a thread, each compared with ``rows``."""

    def __init__(self, client: PSClient, rows: F32) -> None:
        self.client, self.rows = client, rows
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                got = self.client.lookup("t", KEYS)
            except Exception as exc:  # every failure is recorded and fails the test
                self.failures.append(repr(exc))
                continue
            if not np.array_equal(got, self.rows):
                self.failures.append(f"rows differ at {int(np.argmax(np.any(got != self.rows, axis=1)))}")
            else:
                self.ok += 1

    def more(self, timeout_s: float = 60.0) -> None:
        """Wait until a few more lookups succeeded."""
        target = self.ok + 5
        until(lambda: self.ok >= target, lambda: self.failures[-3:], timeout_s)

    def __enter__(self) -> Lookups:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


def lookups_served(address: str) -> int:
    """Keys the replica at ``address`` looked up, by its own Stats."""
    with PSClient([address]) as client:
        return sum(t["lookups"] for t in client.admin.stats()[0]["tables"])


def test_replicas_join_drain_and_die_under_lookups_without_a_failed_call(
    training: tuple[LocalCluster, F32], tmp_path: Path
) -> None:
    cluster, rows = training
    with ServingReplicas(cluster.addresses, tmp_path / "serving") as replicas:
        until(lambda: all(health(a) == "SERVING" for s in replicas.addresses for a in s), lambda: replicas.addresses)
        config = ClientConfig(deadline_s=30, membership_refresh_s=0.5)
        with PSClient(addresses_file=replicas.addresses_file, config=config) as client, Lookups(client, rows) as load:
            load.more()
            for _ in range(2):  # a second replica of each shard, then a third
                added = [replicas.add(s) for s in range(2)]
                for r in added:  # it takes calls once it has its rows: its own counters say so
                    until(lambda r=r: lookups_served(r.address) > 0, lambda: client.admin.replica_health())
                load.more()
            assert [len(a) for a in replicas.addresses] == [3, 3]
            first = replicas.addresses[0][0]
            assert replicas.remove(first) == 0  # SIGTERM: drains, then exits 0
            assert first not in client.addresses
            load.more()
            assert replicas.remove(replicas.addresses[1][0], kill=True) == -signal.SIGKILL
            load.more()
            until(lambda: len(client.addresses) == 4, lambda: client.admin.replica_health())
            load.more()
        assert load.failures == []
        assert client.replicas == [tuple(a) for a in replicas.addresses]


def test_a_new_follower_is_not_ready_until_it_has_its_rows(training: tuple[LocalCluster, F32], tmp_path: Path) -> None:
    cluster, rows = training
    with contextlib.ExitStack() as stack:
        proxy = stack.enter_context(FaultProxy(cluster.addresses[0]))
        proxy.set_mode("blackhole")  # the follower cannot reach its training shard yet
        ready = stack.enter_context(ServingReplicas(cluster.addresses, tmp_path / "ready"))
        until(lambda: all(health(a) == "SERVING" for s in ready.addresses for a in s), lambda: ready.addresses)
        late = start_shard(0, 2, tmp_path / "late", "--mode=serve", f"--follow={proxy.address}")
        stack.callback(lambda: late.proc.kill())
        assert health(late.address) == "NOT_SERVING"  # listening, answering, not ready
        ready_file = ready.addresses_file.read_text().strip().split(",")
        members = tmp_path / "members"
        members.write_text(f"{ready_file[0]}+{late.address},{ready_file[1]}\n")
        config = ClientConfig(deadline_s=30, membership_refresh_s=0.2)
        with PSClient(addresses_file=members, config=config) as client, Lookups(client, rows) as load:
            load.more()
            time.sleep(1.0)  # several membership rounds: the late replica stays out
            load.more()
            assert lookups_served(late.address) == 0
            assert {h["address"]: h["state"] for h in client.admin.replica_health()}[late.address] in (
                "pending",
                "draining",
            )
            proxy.set_mode("pass")
            until(lambda: health(late.address) == "SERVING", lambda: late.log_tail())
            until(lambda: lookups_served(late.address) > 0, lambda: client.admin.replica_health())
            load.more()
        assert load.failures == []


def test_sigterm_drains_a_serving_shard_then_it_exits_0(training: tuple[LocalCluster, F32], tmp_path: Path) -> None:
    cluster, rows = training
    shard = start_shard(1, 2, tmp_path, "--mode=serve", f"--follow={cluster.addresses[1]}", "--drain-s=3")
    try:
        until(lambda: health(shard.address) == "SERVING", shard.log_tail)
        shard.proc.send_signal(signal.SIGTERM)
        until(lambda: health(shard.address) == "NOT_SERVING", shard.log_tail, timeout_s=10)
        with PSClient([cluster.addresses[0], shard.address]) as client:
            got = client.lookup("t", KEYS)  # answered while draining
        np.testing.assert_array_equal(got, rows)
        assert shard.proc.wait(60) == 0, shard.log_tail()
        assert "draining drain_s=3.0" in shard.log_tail()
    finally:
        _kill(shard)


def test_sigint_stops_a_serving_shard_without_draining(training: tuple[LocalCluster, F32], tmp_path: Path) -> None:
    cluster, _ = training
    shard = start_shard(0, 2, tmp_path, "--mode=serve", f"--follow={cluster.addresses[0]}", "--drain-s=600")
    try:
        shard.proc.send_signal(signal.SIGINT)
        assert shard.proc.wait(60) == 0, shard.log_tail()
        assert "draining" not in shard.log_tail()
    finally:
        _kill(shard)


def test_a_second_sigterm_ends_a_drain_and_more_do_no_harm(training: tuple[LocalCluster, F32], tmp_path: Path) -> None:
    """A launcher may signal a group, then each process: the second SIGTERM cuts a drain short,
    and the ones after it, even as the interpreter exits, neither hang nor kill the process."""
    cluster, _ = training
    shard = start_shard(0, 2, tmp_path, "--mode=serve", f"--follow={cluster.addresses[0]}", "--drain-s=600")
    try:
        until(lambda: health(shard.address) == "SERVING", shard.log_tail)
        signals, deadline = 0, time.monotonic() + 60
        while shard.proc.poll() is None and time.monotonic() < deadline:
            shard.proc.send_signal(signal.SIGTERM)
            signals += 1
            time.sleep(0.002)
        assert shard.proc.wait(5) == 0, shard.log_tail()
        assert signals > 1 and "draining drain_s=600.0" in shard.log_tail()
    finally:
        _kill(shard)


def _kill(shard: ShardProcess) -> None:
    if shard.proc.poll() is None:
        shard.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            shard.proc.wait(10)


def test_serving_replicas_grow_with_a_training_reshard(tmp_path: Path) -> None:
    """2 training shards with 2 serving replicas each grow to 3 shards live (``ps-admin
    scale --serving-to``, the new shard's replicas named by ``dns:`` entries); a client
    following the replicas' file reads the same rows throughout, from 3 shards after."""
    args = (f"--data-dir={tmp_path}/data-{{shard}}", "--durability=every-push", "--reshard-settle-s=1")
    with LocalCluster(2, root=tmp_path / "training", extra_args=args) as training:
        with PSClient(training.addresses) as client:
            client.create_table("t", 8, initializer="normal", seed=5)
            client.push("t", KEYS, np.ones((KEYS.shape[0], 8), np.float32))
            rows = client.lookup("t", KEYS)
        replicas = ServingReplicas(training.addresses, tmp_path / "serving", per_shard=2).start()
        try:
            until(
                lambda: all(health(a) == "SERVING" for s in replicas.addresses for a in s), lambda: replicas.addresses
            )
            config = ClientConfig(deadline_s=30, membership_refresh_s=0.5)
            with (
                PSClient(addresses_file=replicas.addresses_file, config=config) as client,
                Lookups(client, rows) as load,
            ):
                load.more()
                (spare,) = training.add_shards(1)
                replicas.add_shards([spare.address])
                before = ["+".join(a) for a in replicas.addresses[:2]]
                after = [*before, "+".join(f"dns:{a}" for a in replicas.addresses[2])]

                def scale() -> str:
                    lists = [training.addresses[:2], training.addresses, before, after]
                    flags = ("--addresses", "--to", "--serving-addresses", "--serving-to")
                    return ok(ps_admin("scale", *(f"{f}={','.join(a)}" for f, a in zip(flags, lists)), cwd=tmp_path))

                out = scale()
                assert ", serving " in out, out  # the serving shards switched maps too
                load.more()
                assert client.num_shards == 3 and client.epoch >= 1  # learnt from a serving shard
                replicas.set_size(3)
                until(lambda: client.replicas == [tuple(a) for a in replicas.addresses], client.admin.replica_health)
                for replica in replicas.replicas[2]:
                    until(lambda r=replica: lookups_served(r.address) > 0, client.admin.replica_health)
                load.more()
                # A replica started now by hand follows its training shard but routes by the map it
                # started with (epoch 0): it refuses what clients route by the new one, and they
                # go to the others, until it is given the serving map.
                # One started with --serving-peers asks them for their map and takes it by itself.
                follow = f"--follow={training.addresses[0]}"
                late = start_shard(0, 2, tmp_path / "late", "--mode=serve", follow)
                peer = f"--serving-peers=dns:{replicas.addresses[0][0]}"
                auto = start_shard(0, 2, tmp_path / "auto", "--mode=serve", follow, peer)
                try:
                    until(lambda: health(late.address) == "SERVING", late.log_tail)
                    listed = replicas.addresses_file.read_text().strip().split(",")
                    members = tmp_path / "members"
                    members.write_text(f"{listed[0]}+{late.address}+{auto.address},{listed[1]},{listed[2]}\n")
                    members.replace(replicas.addresses_file)
                    until(lambda: late.address in client.addresses, client.admin.replica_health)
                    until(lambda: lookups_served(auto.address) > 0, auto.log_tail)
                    assert "took the serving map of peer" in auto.log_tail()
                    load.more()
                    # The scale run again (the Kubernetes Job, after an autoscaler added replicas)
                    # finds the cluster there and gives the serving replicas the map.
                    after[0] = f"{after[0]}+{late.address}"
                    again = scale()
                    assert "nothing to do" in again, again
                    until(lambda: lookups_served(late.address) > 0, client.admin.replica_health)
                    load.more()
                finally:
                    _kill(late)
                    _kill(auto)
            assert load.failures == []
        finally:
            replicas.stop(quietly=True)


def test_a_replica_added_from_a_thread_outlives_the_thread(training: tuple[LocalCluster, F32], tmp_path: Path) -> None:
    """A shard asks Linux for SIGTERM when the thread that started it ends: replicas added
    by a short-lived thread (an autoscaler's, a benchmark's event) must not die with it."""
    cluster, _ = training
    with ServingReplicas(cluster.addresses, tmp_path / "threads") as replicas:
        added: list[ShardProcess] = []
        adder = threading.Thread(target=lambda: added.append(replicas.add(0)))
        adder.start()
        adder.join(120)
        until(lambda: health(added[0].address) == "SERVING", added[0].log_tail)
        time.sleep(1.0)  # a signal from the thread's end would have arrived by now
        assert added[0].proc.poll() is None, added[0].log_tail()
        assert health(added[0].address) == "SERVING"
