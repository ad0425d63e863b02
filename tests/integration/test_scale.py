"""``ps-admin scale`` against real shard processes: a training cluster grows and shrinks
while a client pushes, and a reshard interrupted by kill -9 (of ps-admin, of a new owner,
of a frozen old owner) is finished by running the command again; ``ps-admin erase`` typed
during the hand-over waits for the commit and erases the moving keys on their new owner.

Every check is on what the client saw acknowledged: after the moves each key's row is its
initial row minus every acknowledged push once (SGD, lr 1, the same gradient each time:
the float sums are exact in order), and each key lives on the one shard that owns it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from client import ClientConfig, PSClient
from deploy.operations import GrpcShards
from protos import ps_pb2 as pb
from protos.keys import shard_of
from ps.elastic import ClusterMap
from ps.store import RowFormat, Storage
from tests.integration.shards import RunningShard, start_shard, stop_shard
from tests.integration.test_admin import ok, ps_admin

KEYS = (np.arange(3000, dtype=np.int64) - 1500) * 104729
STEP = np.float32(0.25)
FAST = ClientConfig(backoff_initial_s=0.005, backoff_max_s=0.05, deadline_s=60.0, tune_malloc=False)


class Trainer:
    """A client pushing ``STEP`` to every key of ``KEYS`` in a loop, counting what was acknowledged."""

    def __init__(self, addresses: list[str]) -> None:
        self.client = PSClient(addresses, FAST, client_id="scale-test").start()
        self.client.create_table("t", 8, optimizer="sgd", lr=1.0, seed=11)
        self.start = self.client.lookup("t", KEYS)
        self.acknowledged = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        grads = np.full((KEYS.size, 8), STEP, np.float32)
        try:
            while not self._stop.is_set():
                self.client.lookup("t", KEYS)
                self.client.push("t", KEYS, grads)
                self.acknowledged += 1
        except BaseException as exc:  # the test fails on it below
            self.error = exc

    def finish(self) -> np.ndarray:
        self._stop.set()
        self._thread.join(120)
        assert self.error is None, f"the trainer failed: {self.error!r}"
        assert self.acknowledged > 0
        rows = self.client.lookup("t", KEYS)
        self.client.close()
        return rows

    def expected(self) -> np.ndarray:
        want = self.start.copy()
        for _ in range(self.acknowledged):
            want = want - STEP
        return want


def shard_args(root: Path) -> tuple[str, ...]:
    return (f"--data-dir={root}/data-{{shard}}", "--durability=every-push", "--reshard-settle-s=1")


@pytest.fixture
def shards(tmp_path: Path) -> Iterator[dict[int, RunningShard]]:
    running: dict[int, RunningShard] = {}
    yield running
    for shard in running.values():
        if shard.proc.poll() is None:
            stop_shard(shard)


def addresses(shards: dict[int, RunningShard], n: int) -> list[str]:
    return [shards[i].address for i in range(n)]


def assert_owned(root: Path, shards: dict[int, RunningShard], n: int) -> None:
    """Stopped, each shard of the map of ``n`` holds on disk exactly the keys it owns, and
    every other shard none (read from the data dirs)."""
    for shard in shards.values():
        if shard.proc.poll() is None:
            stop_shard(shard)
    for i in shards:
        with Storage(root / f"data-{i}", shard=-1, num_shards=0, read_only=True) as st:
            keys = np.concatenate(
                [part.keys for part in st.table("t", RowFormat(8, 0)).scan()] or [np.empty(0, np.int64)]
            )
        want = KEYS[shard_of(KEYS, n) == i] if i < n else np.empty(0, np.int64)
        np.testing.assert_array_equal(np.sort(keys), np.sort(want), err_msg=f"shard {i}'s keys")


def prepare_and_freeze(calls: GrpcShards, src: list[str], dst: list[str]) -> pb.ClusterMap:
    """The reshard from ``src`` to ``dst`` prepared on every shard of ``dst`` and the old owners
    frozen, as ``ps-admin scale`` does before the hand-over; the map moved to."""
    to = ClusterMap(1, len(dst), tuple(dst)).to_proto()
    prepare = pb.ReshardRequest(
        phase=pb.ReshardRequest.PREPARE, to=to, **{"from": ClusterMap(0, len(src), tuple(src)).to_proto()}
    )
    for address in dst:
        calls.reshard(address, prepare)
    for address in src:
        calls.reshard(address, pb.ReshardRequest(phase=pb.ReshardRequest.FREEZE, to=to))
    return to


def test_a_cluster_grows_and_shrinks_while_a_client_trains(tmp_path: Path, shards: dict[int, RunningShard]) -> None:
    for i in range(2):
        shards[i] = start_shard(i, 2, tmp_path, *shard_args(tmp_path))
    trainer = Trainer(addresses(shards, 2))
    time.sleep(0.3)
    shards[2] = start_shard(2, 3, tmp_path, *shard_args(tmp_path))
    out = ok(
        ps_admin(
            "scale", "--addresses", ",".join(addresses(shards, 2)), "--to", ",".join(addresses(shards, 3)), cwd=tmp_path
        )
    )
    assert "resharded from 2 to 3 shards" in out and "rows" in out
    time.sleep(0.3)
    out = ok(
        ps_admin(
            "scale", "--addresses", ",".join(addresses(shards, 3)), "--to", ",".join(addresses(shards, 2)), cwd=tmp_path
        )
    )
    assert "resharded from 3 to 2 shards" in out
    time.sleep(0.3)
    got = trainer.finish()
    np.testing.assert_array_equal(got, trainer.expected())  # every acknowledged push once, none twice
    assert trainer.client.epoch == 2 and trainer.client.num_shards == 2
    deadline = time.monotonic() + 30
    while True:  # the retired shard drops what it gave away, then holds nothing
        with PSClient([shards[2].address], FAST) as one:
            rows = one.admin.stats()[0]["tables"][0]["rows"]
        if rows == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert rows == 0
    assert_owned(tmp_path, shards, 2)
    # Restarted with the flags they were first given, the shards keep the map they moved to.
    for i in range(3):
        shards[i] = start_shard(i, 2 if i < 2 else 3, tmp_path, *shard_args(tmp_path), listen=shards[i].address)
    with PSClient(addresses(shards, 2), FAST) as client:
        np.testing.assert_array_equal(client.lookup("t", KEYS), got)
        assert client.admin.stats()[0]["num_shards"] == 2


def test_a_reshard_interrupted_by_kill_9_finishes_when_run_again(
    tmp_path: Path, shards: dict[int, RunningShard]
) -> None:
    for i in range(2):
        shards[i] = start_shard(i, 2, tmp_path, *shard_args(tmp_path))
    trainer = Trainer(addresses(shards, 2))
    shards[2] = start_shard(2, 3, tmp_path, *shard_args(tmp_path))
    src, dst = addresses(shards, 2), addresses(shards, 3)
    calls = GrpcShards(10.0)
    try:
        # 1. The new owner is killed while it copies, and restarted: it copies again.
        prepare = pb.ReshardRequest(
            phase=pb.ReshardRequest.PREPARE,
            to=ClusterMap(1, 3, tuple(dst)).to_proto(),
            **{"from": ClusterMap(0, 2, tuple(src)).to_proto()},
        )
        for address in dst:
            calls.reshard(address, prepare)
        os.kill(shards[2].proc.pid, signal.SIGKILL)
        shards[2].proc.wait(30)
        shards[2] = start_shard(2, 3, tmp_path, *shard_args(tmp_path), listen=shards[2].address)
        # 2. An old owner is killed while frozen, and restarted: it is still frozen.
        calls.reshard(src[0], pb.ReshardRequest(phase=pb.ReshardRequest.FREEZE, to=prepare.to))
        os.kill(shards[0].proc.pid, signal.SIGKILL)
        shards[0].proc.wait(30)
        shards[0] = start_shard(0, 2, tmp_path, *shard_args(tmp_path), listen=shards[0].address)
        assert calls.get_map(src[0]).reshard.phase == "frozen"
    finally:
        calls.close()
    # 3. ps-admin itself is killed mid-way, then run again to the end.
    command = [Path(sys.executable).parent / "ps-admin", "scale", "--addresses", ",".join(src), "--to", ",".join(dst)]
    proc = subprocess.Popen([str(c) for c in command], cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    proc.kill()
    proc.wait(30)
    out = ok(ps_admin("scale", "--addresses", ",".join(src), "--to", ",".join(dst), cwd=tmp_path))
    assert "resharded from 2 to 3" in out or "nothing to do" in out
    time.sleep(0.3)
    got = trainer.finish()
    np.testing.assert_array_equal(got, trainer.expected())
    deadline = time.monotonic() + 30
    calls = GrpcShards(10.0)
    while calls.get_map(src[0]).reshard.phase != "done" and time.monotonic() < deadline:  # dropped what it gave
        time.sleep(0.1)
    calls.close()
    assert_owned(tmp_path, shards, 3)


def test_an_abort_without_the_lost_new_shard_unfreezes_the_old_owners(
    tmp_path: Path, shards: dict[int, RunningShard]
) -> None:
    for i in range(2):
        shards[i] = start_shard(i, 2, tmp_path, *shard_args(tmp_path))
    shards[2] = start_shard(2, 3, tmp_path, *shard_args(tmp_path))
    src, dst = addresses(shards, 2), addresses(shards, 3)
    calls = GrpcShards(10.0)
    try:
        prepare_and_freeze(calls, src, dst)
        os.kill(shards[2].proc.pid, signal.SIGKILL)  # lost with its disk: nobody will listen there again
        shards[2].proc.wait(30)
        shards[3] = start_shard(2, 3, tmp_path / "replacement")  # the operator types its address instead
        typed = [*src, shards[3].address]
        done = ps_admin("scale", "--abort", "--addresses", ",".join(src), "--to", ",".join(typed), cwd=tmp_path)
        said = ok(done) + done.stderr
        assert "aborted" in said and f"{dst[2]} could not be reached" in said, said
        assert all(not calls.get_map(a).reshard.phase for a in src)  # nobody frozen
    finally:
        calls.close()
    with PSClient(src, FAST) as client:
        client.create_table("t", 8, optimizer="sgd", lr=1.0, seed=11)
        client.push("t", KEYS, np.full((KEYS.size, 8), STEP, np.float32))  # every key takes pushes again


def test_spare_shards_join_grows_at_any_epoch(tmp_path: Path, shards: dict[int, RunningShard]) -> None:
    """Shards started past the end of the cluster they are told of (a StatefulSet's new pods,
    all given the same --num-shards) own nothing until a grow takes them in, at the first
    reshard or a later one."""
    for i in range(2):
        shards[i] = start_shard(i, 2, tmp_path, *shard_args(tmp_path))
    shards[2] = start_shard(2, 2, tmp_path, *shard_args(tmp_path))
    trainer = Trainer(addresses(shards, 2))
    with PSClient(addresses(shards, 3), FAST) as wrong:  # a client told of the spare is refused, clearly
        wrong.create_table("t", 8, optimizer="sgd", lr=1.0, seed=11)
        with pytest.raises(Exception, match="is a spare outside the cluster of 2|does not match the cluster"):
            wrong.lookup("t", KEYS)
    ok(
        ps_admin(
            "scale", "--addresses", ",".join(addresses(shards, 2)), "--to", ",".join(addresses(shards, 3)), cwd=tmp_path
        )
    )
    ok(
        ps_admin(
            "scale", "--addresses", ",".join(addresses(shards, 3)), "--to", ",".join(addresses(shards, 2)), cwd=tmp_path
        )
    )
    shards[3] = start_shard(3, 2, tmp_path, *shard_args(tmp_path))  # a spare at epoch 0 joins epoch 2
    out = ok(
        ps_admin(
            "scale", "--addresses", ",".join(addresses(shards, 2)), "--to", ",".join(addresses(shards, 4)), cwd=tmp_path
        )
    )
    assert "resharded from 2 to 4 shards" in out
    got = trainer.finish()
    np.testing.assert_array_equal(got, trainer.expected())
    assert trainer.client.epoch == 3 and trainer.client.num_shards == 4
    assert_owned(tmp_path, shards, 4)


def test_scale_says_what_is_wrong_in_one_line(tmp_path: Path, shards: dict[int, RunningShard]) -> None:
    for i in range(2):
        shards[i] = start_shard(i, 2, tmp_path, *shard_args(tmp_path))
    shards[2] = start_shard(2, 4, tmp_path, *shard_args(tmp_path))  # started for another map
    src = addresses(shards, 2)
    bad = ps_admin("scale", "--addresses", ",".join(src), "--to", ",".join([*src, shards[2].address]), cwd=tmp_path)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert "--shard 2 --num-shards 3" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    swapped = ps_admin(
        "scale", "--addresses", ",".join(src), "--to", ",".join([src[1], src[0], shards[2].address]), cwd=tmp_path
    )
    assert swapped.returncode == 1 and "keep their places" in swapped.stderr


def test_serving_shards_follow_a_reshard_and_their_readers_never_fail(
    tmp_path: Path, shards: dict[int, RunningShard]
) -> None:
    for i in range(2):
        shards[i] = start_shard(i, 2, tmp_path, *shard_args(tmp_path))
    trainer = Trainer(addresses(shards, 2))
    serving: dict[int, RunningShard] = {}
    serve_root = tmp_path / "serve"
    try:
        for i in range(2):
            serving[i] = start_shard(i, 2, serve_root, "--mode=serve", f"--follow={shards[i].address}")
        # Spares, as a StatefulSet grown by one starts them: past the end of the cluster they know.
        shards[2] = start_shard(2, 2, tmp_path, *shard_args(tmp_path))
        serving[2] = start_shard(2, 2, serve_root, "--mode=serve", f"--follow={shards[2].address}")
        reader = PSClient([serving[0].address, serving[1].address], FAST)
        stop, failures, reads = threading.Event(), [], [0]

        def read() -> None:
            while not stop.is_set():
                try:
                    rows = reader.lookup("t", KEYS)
                    assert rows.shape == (KEYS.size, 8)
                    reads[0] += 1
                except Exception as exc:
                    failures.append(exc)

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        time.sleep(0.3)
        out = ok(
            ps_admin(
                "scale",
                "--addresses",
                ",".join(addresses(shards, 2)),
                "--to",
                ",".join(addresses(shards, 3)),
                "--serving-addresses",
                ",".join(serving[i].address for i in range(2)),
                "--serving-to",
                ",".join(serving[i].address for i in range(3)),
                cwd=tmp_path,
            )
        )
        assert "resharded from 2 to 3" in out
        time.sleep(0.5)
        got = trainer.finish()
        deadline = time.monotonic() + 30
        while not np.array_equal(reader.lookup("t", KEYS), got):  # the followers catch up with the last pushes
            assert time.monotonic() < deadline, "the serving shards never caught up"
            time.sleep(0.1)
        stop.set()
        thread.join(30)
        assert failures == [] and reads[0] > 5
        assert reader.epoch == 1 and reader.num_shards == 3
        reader.close()
    finally:
        for shard in serving.values():
            if shard.proc.poll() is None:
                stop_shard(shard)


def test_ps_admin_erase_during_the_hand_over_waits_for_the_commit(
    tmp_path: Path, shards: dict[int, RunningShard]
) -> None:
    """An erase typed while the old owners are frozen for the hand-over: they refuse it for the
    moving keys before erasing anything; ``ps-admin erase`` waits (it says it is retrying) and,
    once the reshard commits, erases them on their new owner, with a receipt of every place absent."""
    for i in range(2):
        shards[i] = start_shard(i, 2, tmp_path, *shard_args(tmp_path))
    shards[2] = start_shard(2, 3, tmp_path, *shard_args(tmp_path))
    src, dst = addresses(shards, 2), addresses(shards, 3)
    with PSClient(src, FAST) as client:
        client.create_table("t", 8, optimizer="sgd", lr=1.0, seed=11)
        client.push("t", KEYS, np.full((KEYS.size, 8), STEP, np.float32))
    moving = KEYS[shard_of(KEYS, 2) != shard_of(KEYS, 3)][:50]
    erased = np.concatenate([moving, KEYS[shard_of(KEYS, 2) == shard_of(KEYS, 3)][:50]])
    (tmp_path / "keys.txt").write_text("".join(f"{k}\n" for k in erased))
    calls = GrpcShards(10.0)
    erase: subprocess.Popen[str] | None = None
    try:
        to = prepare_and_freeze(calls, src, dst)
        script = Path(sys.executable).parent / "ps-admin"
        erase = subprocess.Popen(
            [str(script), "erase", "--addresses", ",".join(src), "--table", "t", "--keys", "keys.txt"]
            + ["--receipt", "receipt.json"],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert erase.stderr is not None
        said = ""
        while "Erase: retrying" not in said:  # the client's one warning when it first waits
            line = erase.stderr.readline()
            assert line, f"ps-admin erase ended without waiting:\n{said}"
            said += line
        assert "moves from shard" in said, said
        deadline = time.monotonic() + 60
        status = pb.ReshardRequest(phase=pb.ReshardRequest.STATUS, to=to)
        while not all(s.complete for s in calls.reshard(dst[2], status).sources):
            assert time.monotonic() < deadline, "the copies never completed"
            time.sleep(0.05)
        for address in (dst[2], *src):
            calls.reshard(address, pb.ReshardRequest(phase=pb.ReshardRequest.COMMIT, to=to))
        out, err = erase.communicate(timeout=120)
        assert erase.returncode == 0, f"{out}\n{said}{err}"
        deadline = time.monotonic() + 30
        while any(calls.get_map(a).reshard.phase != "done" for a in src):  # dropped what they gave
            assert time.monotonic() < deadline, "the old owners did not drop the rows they gave away"
            time.sleep(0.05)
    finally:
        calls.close()
        if erase is not None and erase.poll() is None:
            erase.kill()
            erase.communicate()
    receipt = json.loads((tmp_path / "receipt.json").read_text())
    assert receipt["absent_everywhere"] and len(receipt["training"]) == 3
    # Each key's row at its owner, and the copy an old owner has not dropped yet, if any.
    assert sum(t["rows_in_ram"] + t["rows_on_disk"] for t in receipt["training"]) >= erased.size
    for shard in shards.values():
        stop_shard(shard)
    for i in range(3):
        with Storage(tmp_path / f"data-{i}", shard=-1, num_shards=0, read_only=True) as st:
            keys = np.concatenate([part.keys for part in st.table("t", RowFormat(8, 0)).scan()])
        assert not np.isin(erased, keys).any(), f"shard {i} still holds erased keys"
        np.testing.assert_array_equal(np.sort(keys), np.sort(np.setdiff1d(KEYS[shard_of(KEYS, 3) == i], erased)))


@pytest.mark.parametrize("roots", ["a-root-per-shard", "one-shared-root"])
def test_an_erase_after_a_grow_reaches_the_old_owners_checkpoints(
    tmp_path: Path, shards: dict[int, RunningShard], roots: str
) -> None:
    """A checkpoint taken before the cluster grew holds the moved keys in their old owner's
    part, under that shard's root; the erase, sent after the move to the keys' new owner,
    must rewrite that part too (or a restore of it brings them back), and the receipt must
    not say absent while it holds them. With one root the shards share, every shard finds
    every part: they must not trip over each other rewriting the same ones."""
    shared = ("--checkpoint-root=" + str(tmp_path / "ckpt"),) if roots == "one-shared-root" else ()
    for i in range(2):
        shards[i] = start_shard(i, 2, tmp_path, *shard_args(tmp_path), *shared)
    with PSClient(addresses(shards, 2), FAST) as client:
        client.create_table("t", 8, optimizer="sgd", lr=1.0, seed=11)
        client.push("t", KEYS, np.full((KEYS.size, 8), STEP, np.float32))
    ok(ps_admin("checkpoint", "--addresses", ",".join(addresses(shards, 2)), "--out", "before", cwd=tmp_path))
    shards[2] = start_shard(2, 3, tmp_path, *shard_args(tmp_path), *shared)
    src, dst = addresses(shards, 2), addresses(shards, 3)
    assert "resharded from 2 to 3" in ok(
        ps_admin("scale", "--addresses", ",".join(src), "--to", ",".join(dst), cwd=tmp_path)
    )
    moved = KEYS[shard_of(KEYS, 2) != shard_of(KEYS, 3)][:100]
    erased = np.concatenate([moved, KEYS[shard_of(KEYS, 2) == shard_of(KEYS, 3)][:100]])
    (tmp_path / "keys.txt").write_text("".join(f"{k}\n" for k in erased))
    out = ok(
        ps_admin(
            "erase",
            "--addresses",
            ",".join(dst),
            "--table",
            "t",
            "--keys",
            "keys.txt",
            "--receipt",
            "r.json",
            cwd=tmp_path,
        )
    )
    receipt = json.loads((tmp_path / "r.json").read_text())
    assert receipt["absent_everywhere"], out
    rewritten = sum(c["rows"] for t in receipt["training"] for c in t["checkpoints_rewritten"])
    assert rewritten == erased.size, out  # each key's row once, from the part of the shard that owned it then
    ok(ps_admin("erase", "--addresses", ",".join(dst), "--verify", "r.json", cwd=tmp_path))
    calls = GrpcShards(10.0)
    deadline = time.monotonic() + 30
    while any(calls.get_map(a).reshard.phase != "done" for a in src):  # dropped what they gave
        assert time.monotonic() < deadline, "the old owners did not drop the rows they gave away"
        time.sleep(0.05)
    calls.close()
    for shard in shards.values():
        stop_shard(shard)
    parts = sorted(p.parent for p in tmp_path.rglob("manifest.json") if (p.parent / "db").is_dir())
    assert len(parts) == 2, parts  # the checkpoint's two parts
    for path in [*parts, *(tmp_path / f"data-{i}" for i in range(3))]:
        with Storage(path, shard=-1, num_shards=0, read_only=True) as st:
            keys = np.concatenate([part.keys for part in st.table("t", RowFormat(8, 0)).scan()])
        assert keys.size and not np.isin(erased, keys).any(), f"{path} still holds erased keys"
