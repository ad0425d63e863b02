"""Serving shards as real processes: read-only mode, following a training shard, pinning.

Every shard here is a real ``ps-server`` on 127.0.0.1; training shards and their
followers run from separate directories (each keeps its own port file and data).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import PSClient
from client.config import ClientConfig
from client.errors import InvalidRequestError, PreconditionError
from tests.integration.shards import RunningShard, start_shard, stop_shard

DIM = 8
FAST = ClientConfig(deadline_s=10)


def stats(address: str) -> dict:  # type: ignore[type-arg]
    with PSClient([address], FAST) as c:
        return c.admin.stats()[0]


def wait_caught_up(follower: str, leader: str, timeout_s: float = 20.0, snapshots: int = 0) -> dict:  # type: ignore[type-arg]
    """The follower's stats once it applied the leader's newest version (and, after a
    leader restart, the ``snapshots``-th snapshot: versions of the old history are not
    comparable with the new one's, so until then a version check alone could pass)."""
    deadline = time.monotonic() + timeout_s
    while True:
        target = stats(leader)["version"]
        s = stats(follower)
        f = s["follow"]
        if f["applied_version"] >= target and f["connected"] and f["snapshots"] >= snapshots:
            return s
        assert time.monotonic() < deadline, f"follower stuck at {s['follow']} (leader at {target})"
        time.sleep(0.05)


@pytest.fixture
def leader(tmp_path: Path) -> Iterator[RunningShard]:
    shard = start_shard(0, 1, tmp_path / "train", f"--data-dir={tmp_path / 'train' / 'data'}")
    yield shard
    if shard.proc.poll() is None:
        stop_shard(shard)


def follower_of(leader: RunningShard, root: Path, *extra: str) -> RunningShard:
    return start_shard(0, 1, root, "--mode=serve", f"--follow={leader.address}", *extra)


def test_serving_shard_refuses_every_write_and_creates_nothing(tmp_path: Path) -> None:
    data = tmp_path / "train" / "data"
    trained = start_shard(0, 1, tmp_path / "train", f"--data-dir={data}")
    with PSClient([trained.address], FAST) as c:
        c.create_table("item", DIM, optimizer="sgd", lr=0.5)
        c.create_table("init", DIM, serving_default="initial")
        c.push("item", np.arange(10), np.ones((10, DIM), np.float32))
        expected = c.lookup("item", np.arange(10))
    stop_shard(trained)
    other = start_shard(0, 1, tmp_path / "fresh")
    with PSClient([other.address], FAST) as fresh:
        fresh.create_table("init", DIM, serving_default="initial")
        initial = fresh.lookup("init", np.array([77, 78]))  # rows a training shard creates for them
    stop_shard(other)

    serving = start_shard(0, 1, tmp_path / "serve", "--mode=serve", f"--data-dir={data}")
    try:
        with PSClient([serving.address], FAST) as c:
            before = c.admin.stats()[0]
            rows = c.lookup("item", np.array([3, 1000, 0, 10**12]))
            np.testing.assert_array_equal(rows[[0, 2]], expected[[3, 0]])
            assert not rows[[1, 3]].any(), "unknown keys read as the serving default, zeros"
            np.testing.assert_array_equal(c.lookup("init", np.array([77, 78])), initial)  # serving_default=initial
            for write, name in [
                (lambda: c.push("item", np.array([1]), np.ones((1, DIM), np.float32)), "Push"),
                (lambda: c.create_table("other", DIM), "CreateTable"),
                (lambda: c.admin.checkpoint(), "Checkpoint"),
            ]:
                with pytest.raises(PreconditionError, match=rf"{name} refused: .*mode=serve"):
                    write()
            after = c.admin.stats()[0]
            np.testing.assert_array_equal(c.lookup("item", np.arange(10)), expected)
        assert after["mode"] == "serve" and after["follow"]["source"] == "data-dir"
        (_, b), (_, a) = before["tables"], after["tables"]  # init, item
        assert a["rows"] == b["rows"] == 10 and a["rows_created"] == 0 and a["pushes"] == 0
        assert [t["name"] for t in after["tables"]] == ["init", "item"] and after["tables"][0]["rows"] == 0
    finally:
        stop_shard(serving)


def test_follower_converges_exactly_under_concurrent_pushes(leader: RunningShard, tmp_path: Path) -> None:
    follower = follower_of(leader, tmp_path / "serve")
    rng = np.random.default_rng(0)
    keys = np.arange(5000)
    stop = threading.Event()
    errors: list[BaseException] = []
    with PSClient([leader.address], FAST) as train, PSClient([follower.address], FAST) as serve:
        train.create_table("item", DIM, optimizer="adagrad", lr=0.1)

        def pushes(seed: int) -> None:
            r = np.random.default_rng(seed)
            try:
                while not stop.is_set():
                    k = r.choice(keys, 300, replace=False)
                    train.push("item", k, r.standard_normal((300, DIM)).astype(np.float32))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=pushes, args=(s,)) for s in range(2)]
        for t in threads:
            t.start()
        try:
            seen_versions = []
            for _ in range(30):  # reads meanwhile never fail and versions only grow
                serve.lookup("item", rng.choice(keys, 500)) if serve.admin.tables() else None
                seen_versions.append(serve.admin.stats()[0]["follow"]["applied_version"])
                time.sleep(0.05)
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not errors, errors
        assert seen_versions == sorted(seen_versions) and seen_versions[-1] > 0
        s = wait_caught_up(follower.address, leader.address)
        np.testing.assert_array_equal(serve.lookup("item", keys), train.lookup("item", keys))
        assert s["follow"]["lag_versions"] == 0 and s["follow"]["lag_s"] == 0.0 and s["follow"]["batches"] > 1
        assert s["tables"][0]["rows"] == stats(leader.address)["tables"][0]["rows"] == keys.size
    stop_shard(follower)


def test_fresh_rows_reach_the_follower_within_a_second(leader: RunningShard, tmp_path: Path) -> None:
    # The goal (p99 <= 1 s under training load) is measured by benchmarks/bench_serving.py;
    # this bound is loose because CI machines are shared.
    follower = follower_of(leader, tmp_path / "serve")
    lags = []
    with PSClient([leader.address], FAST) as train, PSClient([follower.address], FAST) as serve:
        train.create_table("item", DIM)
        train.lookup("item", np.array([7]))
        wait_caught_up(follower.address, leader.address)
        for i in range(20):
            train.push("item", np.array([7]), np.full((1, DIM), 1.0, np.float32))
            want = train.lookup("item", np.array([7]))
            acked = time.monotonic()
            while not np.array_equal(serve.lookup("item", np.array([7])), want):
                assert time.monotonic() - acked < 10, f"push {i} not visible after 10 s"
                time.sleep(0.001)
            lags.append(time.monotonic() - acked)
    stop_shard(follower)
    assert float(np.percentile(lags, 99)) < 3.0, lags


def test_a_table_created_without_rows_reaches_a_follower_that_is_already_streaming(
    leader: RunningShard, tmp_path: Path
) -> None:
    follower = follower_of(leader, tmp_path / "serve")
    with PSClient([leader.address], FAST) as train, PSClient([follower.address], FAST) as serve:
        train.create_table("item", DIM)
        train.lookup("item", np.array([7]))
        wait_caught_up(follower.address, leader.address)
        train.create_table("empty", DIM)  # no row yet: only the spec can tell the follower
        wait_caught_up(follower.address, leader.address)
        np.testing.assert_array_equal(serve.lookup("empty", np.array([1, 2])), np.zeros((2, DIM), np.float32))
    stop_shard(follower)


def test_follower_restart_continues_and_leader_restart_resyncs(leader: RunningShard, tmp_path: Path) -> None:
    serve_root = tmp_path / "serve"
    follower = follower_of(leader, serve_root, f"--data-dir={serve_root / 'data'}")
    keys = np.arange(200)
    with PSClient([leader.address], FAST) as train:
        train.create_table("item", DIM, optimizer="sgd", lr=1.0)
        train.push("item", keys, np.ones((200, DIM), np.float32))
        wait_caught_up(follower.address, leader.address)
        stop_shard(follower)  # its data dir keeps the rows and the version they reach
        train.push("item", keys[:50], np.ones((50, DIM), np.float32))  # while the follower is down
        follower = follower_of(leader, serve_root, f"--data-dir={serve_root / 'data'}")
        s = wait_caught_up(follower.address, leader.address)
        assert s["follow"]["snapshots"] == 0, "a restarted follower continues from its saved version"
        with PSClient([follower.address], FAST) as serve:
            np.testing.assert_array_equal(serve.lookup("item", keys), train.lookup("item", keys))
        expected = train.lookup("item", keys)

    # The training shard restarts: versions begin again in a new history, so the
    # follower reloads a snapshot and serves exactly what the restarted shard holds.
    address = leader.address
    stop_shard(leader)
    restarted = start_shard(0, 1, tmp_path / "train", f"--data-dir={tmp_path / 'train' / 'data'}", listen=address)
    try:
        with PSClient([address], FAST) as train, PSClient([follower.address], FAST) as serve:
            train.push("item", keys[:10], np.ones((10, DIM), np.float32))
            s = wait_caught_up(follower.address, address, snapshots=1)
            assert s["follow"]["snapshots"] == 1 and s["follow"]["lag_versions"] == 0
            now = train.lookup("item", keys)
            np.testing.assert_array_equal(serve.lookup("item", keys), now)
            np.testing.assert_array_equal(now[10:], expected[10:])
    finally:
        stop_shard(follower)
        stop_shard(restarted)


def test_pin_to_a_checkpoint_and_roll_forward_again(leader: RunningShard, tmp_path: Path) -> None:
    root = tmp_path / "train" / "data" / "checkpoints"
    follower = follower_of(leader, tmp_path / "serve", f"--checkpoint-root={root}")
    keys = np.arange(100)
    with PSClient([leader.address], FAST) as train, PSClient([follower.address], FAST) as serve:
        train.create_table("item", DIM, optimizer="sgd", lr=1.0)
        train.push("item", keys, np.ones((100, DIM), np.float32))
        v1 = train.lookup("item", keys)
        (written,) = train.admin.checkpoint()
        path = written["path"]
        train.push("item", keys, np.ones((100, DIM), np.float32))  # a bad update, say
        wait_caught_up(follower.address, leader.address)
        latest = train.lookup("item", keys)
        assert not np.array_equal(v1, latest)

        assert written["name"] == "000001"
        status = serve.admin.serve_from(written["name"])[0]  # roll back
        assert status["source"] == "checkpoint" and status["checkpoint"] == path
        np.testing.assert_array_equal(serve.lookup("item", keys), v1)
        train.push("item", keys[:5], np.ones((5, DIM), np.float32))  # followed on, not served
        time.sleep(0.3)
        np.testing.assert_array_equal(serve.lookup("item", keys), v1)

        assert serve.admin.serve_from(None)[0]["source"] == "follow"  # forward again: catches up
        wait_caught_up(follower.address, leader.address)
        np.testing.assert_array_equal(serve.lookup("item", keys), train.lookup("item", keys))
        with pytest.raises(PreconditionError, match="training shard"):
            train.admin.serve_from("1")
        with pytest.raises(Exception, match="holds no checkpoint"):
            serve.admin.serve_from("999")
    stop_shard(follower)


def test_follow_health_tracks_the_stream(leader: RunningShard, tmp_path: Path) -> None:
    follower = follower_of(leader, tmp_path / "serve")

    def status() -> int:
        with grpc.insecure_channel(follower.address) as ch:
            req = health_pb2.HealthCheckRequest(service="ps.v1.ParameterServer.Follow")
            return int(health_pb2_grpc.HealthStub(ch).Check(req, timeout=5).status)

    serving = health_pb2.HealthCheckResponse.SERVING
    deadline = time.monotonic() + 10
    while status() != serving:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    stop_shard(leader)
    while status() == serving:
        assert time.monotonic() < deadline + 10, "health stayed SERVING with the leader gone"
        time.sleep(0.05)
    s = stats(follower.address)["follow"]
    assert not s["connected"] and "UNAVAILABLE" in s["error"]
    stop_shard(follower)


def test_a_serving_shard_says_it_is_read_only(leader: RunningShard, tmp_path: Path) -> None:
    from tests.integration.test_admin import ps_admin

    follower = follower_of(leader, tmp_path / "serve")
    try:
        assert stats(follower.address)["writable"] is False  # it refuses every push, by mode
        assert stats(follower.address)["storage_error"] == ""
        assert stats(leader.address)["writable"] is True
        with grpc.insecure_channel(follower.address) as ch:
            req = health_pb2.HealthCheckRequest(service="ps.v1.ParameterServer.Writes")
            with pytest.raises(grpc.RpcError) as no_writes:
                health_pb2_grpc.HealthStub(ch).Check(req, timeout=5)
        assert no_writes.value.code() == grpc.StatusCode.NOT_FOUND  # a serving shard has no write service
        printed = ps_admin("stats", "--addresses", follower.address, cwd=tmp_path)
        assert printed.returncode == 0, printed.stderr
        assert "read-only (serve)" in printed.stdout and " yes" not in printed.stdout, printed.stdout
        health = ps_admin("health", "--addresses", follower.address, cwd=tmp_path)
        assert "Writes" not in health.stdout, health.stdout
    finally:
        stop_shard(follower)


def test_lineage_follows_the_data_not_the_process(leader: RunningShard, tmp_path: Path) -> None:
    # Stats.lineage says which data a shard's rows are: ps-infer compares it with the
    # lineage each shard had at training (worker.serving). It must stay while training
    # goes on and across restarts and checkpoints, and differ for other data.
    serve_root = tmp_path / "serve"
    checkpoints = tmp_path / "train" / "data" / "checkpoints"
    follower = follower_of(leader, serve_root, f"--data-dir={serve_root / 'data'}", f"--checkpoint-root={checkpoints}")
    lineage = stats(leader.address)["lineage"]
    assert len(lineage) == 32, lineage
    keys = np.arange(100)
    with PSClient([leader.address], FAST) as train:
        train.create_table("item", DIM, optimizer="sgd", lr=1.0)
        train.push("item", keys, np.ones((100, DIM), np.float32))
        assert wait_caught_up(follower.address, leader.address)["lineage"] == lineage
        (written,) = train.admin.checkpoint()
        train.push("item", keys, np.ones((100, DIM), np.float32))  # training goes on: the same data
        assert stats(leader.address)["lineage"] == lineage
    manifest = json.loads((Path(written["path"]) / "manifest.json").read_text())
    assert manifest["lineage"] == lineage
    with PSClient([follower.address], FAST) as serve:
        assert serve.admin.serve_from(written["name"])[0]["source"] == "checkpoint"
        assert stats(follower.address)["lineage"] == lineage  # the checkpoint's rows: the same data
        serve.admin.serve_from(None)
    stop_shard(follower)

    address = leader.address
    stop_shard(leader)
    restarted = start_shard(0, 1, tmp_path / "train", f"--data-dir={tmp_path / 'train' / 'data'}", listen=address)
    follower = follower_of(restarted, serve_root, f"--data-dir={serve_root / 'data'}")
    try:
        assert stats(address)["lineage"] == lineage, "a restart on the same data dir keeps the lineage"
        assert stats(follower.address)["lineage"] == lineage, "a follower's data dir keeps the lineage it loaded"
        assert wait_caught_up(follower.address, address, snapshots=1)["lineage"] == lineage
    finally:
        stop_shard(follower)
        stop_shard(restarted)

    restored = start_shard(
        0, 1, tmp_path / "restored", f"--data-dir={tmp_path / 'restored' / 'data'}", f"--restore-from={written['path']}"
    )
    ram = start_shard(0, 1, tmp_path / "ram")  # no data dir: new data at every start
    try:
        assert stats(restored.address)["lineage"] == lineage, "a data dir restored from a checkpoint keeps it"
        assert len(stats(ram.address)["lineage"]) == 32 and stats(ram.address)["lineage"] != lineage
        first = stats(ram.address)["lineage"]
        stop_shard(ram)
        ram = start_shard(0, 1, tmp_path / "ram")
        assert stats(ram.address)["lineage"] not in (first, "")
    finally:
        stop_shard(restored)
        stop_shard(ram)


def test_a_loaded_checkpoint_reaches_the_follower_and_a_serving_shard_refuses_it(
    leader: RunningShard, tmp_path: Path
) -> None:
    """LoadCheckpoint replaces the table's rows on the training shard: rows the checkpoint holds
    come back as they were, rows created after it are gone, and the follower serves exactly that."""
    follower = follower_of(leader, tmp_path / "serve")
    keys, later = np.arange(50), np.arange(50, 80)
    with PSClient([leader.address], FAST) as train, PSClient([follower.address], FAST) as serve:
        train.create_table("item", DIM, optimizer="rowwise_adagrad", lr=0.5, serving_default="zeros")
        train.push("item", keys, np.ones((50, DIM), np.float32))
        saved = train.lookup("item", keys)
        (written,) = train.admin.checkpoint()
        train.push("item", np.concatenate([keys, later]), np.ones((80, DIM), np.float32))
        wait_caught_up(follower.address, leader.address)
        assert not np.array_equal(serve.lookup("item", keys), saved)

        (loaded,) = train.admin.load_checkpoint(written["name"], 1, ["item"])
        assert loaded["rows"] == {"item": 50}
        assert stats(leader.address)["tables"][0]["rows"] == 50  # the rows made after it are gone
        wait_caught_up(follower.address, leader.address)
        np.testing.assert_array_equal(serve.lookup("item", keys), saved)
        np.testing.assert_array_equal(serve.lookup("item", later), 0)  # no row: the serving default
        with pytest.raises(PreconditionError, match="LoadCheckpoint refused: .*mode=serve"):
            serve.admin.load_checkpoint(written["name"], 1, ["item"])
        with pytest.raises(InvalidRequestError, match="tables is empty"):
            train.admin.load_checkpoint(written["name"], 1, [])
    stop_shard(follower)
