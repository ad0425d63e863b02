"""Online training as a user runs it: ``python -m worker.trainer --data dir:PATH`` (or a
Redis stream) against real shard processes, killed with SIGKILL at any moment.

The proof of exactly-once in sync mode: a run whose trainer and shards are killed and
restarted (the documented restart: the same command, the same ``--checkpoint-dir``; a
shard on its data dir and address) ends with every row and every dense weight bit-equal
to a run never killed over the same stream. A plain run kills a few times; ``pytest -m
slow`` kills many more times over a longer stream.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from client import PSClient
from tests.integration.shards import RunningShard, start_shard, stop_shard
from tests.integration.test_admin import ok, ps_admin
from tests.profiles import long_run
from tests.redis_server import redis_server
from worker.data import ColumnSchema, read_click_log
from worker.distributed import PID_DIR_ENV

CRITEO = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "criteo_kaggle_train_head10k.txt"
needs_criteo = pytest.mark.skipif(not CRITEO.exists(), reason=f"{CRITEO} is not on this machine")
REPO = Path(__file__).resolve().parents[2]


def land_files(directory: Path, rows: int, per_file: int, start: int = 0) -> None:
    """Criteo rows ``[start, start + rows)`` as files of ``per_file`` rows, renamed in."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = CRITEO.read_bytes().splitlines(keepends=True)[start : start + rows]
    for k in range(0, len(lines), per_file):
        tmp = directory / f".part-{start + k:08d}.tmp"
        tmp.write_bytes(b"".join(lines[k : k + per_file]))
        os.replace(tmp, directory / f"part-{start + k:08d}.tsv")


def trainer_command(addresses: list[str], data: str, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "worker.trainer",
        f"--addresses={','.join(addresses)}",
        f"--data={data}",
        f"--output-dir={out}",
        "--progress=false",
        "--idle-exit-s=1",
        *extra,
    ]


def start_shards(root: Path, procs: list[RunningShard], n: int = 2) -> list[RunningShard]:
    shards = [start_shard(i, n, root, "--data-dir=data-{shard}", "--durability=every-push") for i in range(n)]
    procs.extend(shards)
    return shards


def all_keys(directory: Path) -> np.ndarray:
    """Every key the Criteo rows in ``directory`` give (each table of the trainer reads them all)."""
    keys = [
        np.concatenate([j.values.numpy() for j in batch.sparse.values()])
        for path in sorted(directory.glob("part-*.tsv"))
        for batch in read_click_log(path, ColumnSchema.criteo(), 4096)
    ]
    return np.unique(np.concatenate(keys))


def final_state(addresses: list[str], keys: np.ndarray, out: Path) -> dict[str, np.ndarray]:
    with PSClient(addresses) as client:
        state = {table: client.lookup(table, keys) for table in ("embedding", "wide")}
    dense = torch.load(out / "dense.pt", weights_only=True)
    return state | {f"dense.{k}": v.numpy() for k, v in dense.items()}


def newest_checkpoint(ckpt: Path) -> int:
    steps = [
        int(m.group(1)) for p in ckpt.glob("checkpoint-*.pt") if (m := re.fullmatch(r"checkpoint-(\d+)\.pt", p.name))
    ]
    return max(steps, default=-1)


SHARD_ARGS = ("--data-dir=data-{shard}", "--durability=every-push", "--reshard-settle-s=1")


@needs_criteo
@pytest.mark.parametrize(
    "scale",
    [pytest.param(False, id="kills", marks=pytest.mark.slow), pytest.param(True, id="kills-and-a-live-scale")],
)
def test_kill_anywhere_in_sync_mode_ends_bit_equal_to_a_run_never_killed(
    tmp_path: Path, procs: list[RunningShard], request: pytest.FixtureRequest, scale: bool
) -> None:
    long = long_run(request.config)
    if not scale and not long:
        pytest.skip("runs with `pytest -m slow`: the kills-and-a-live-scale run makes the same kills, and a scale")
    rows, batch = (4000, 64) if long else (1280, 64)
    data = tmp_path / "landed"
    land_files(data, rows, 320)
    batches = -(-320 // batch) * (rows // 320)
    keys = all_keys(data)
    sync = ("--mode=sync", "--batch-size=64", "--checkpoint-every=1", "--validation-window=320")

    # Never killed, never scaled.
    shards = start_shards(tmp_path / "ref", procs)
    addresses = [s.address for s in shards]
    cmd = trainer_command(addresses, f"dir:{data}", tmp_path / "ref-out", f"--checkpoint-dir={tmp_path / 'ref-ckpt'}")
    subprocess.run([*cmd, *sync], check=True, cwd=REPO, timeout=600)
    expected = final_state(addresses, keys, tmp_path / "ref-out")
    for s in shards:
        stop_shard(s)

    # Killed: the trainer, a shard, or both, at random batches, restarted as documented; with
    # `scale`, the cluster also grows from 2 to 3 shards under the training (ps-admin scale).
    rng = random.Random(7)
    victims = ["trainer", "shard", "trainer", "both", "trainer"] * (4 if long else 1)
    victims = victims[: 12 if long else 3]
    if scale:
        victims.insert(len(victims) // 2, "scale")
    at = sorted(rng.sample(range(2, batches - 1), len(victims)))
    root = tmp_path / "killed"
    shards = [start_shard(i, 2, root, *SHARD_ARGS) for i in range(2)]
    procs.extend(shards)
    sizes = [2, 2]  # what each shard was started as
    addresses = [s.address for s in shards]
    ckpt = tmp_path / "killed-ckpt"
    cmd = [*trainer_command(addresses, f"dir:{data}", tmp_path / "killed-out", f"--checkpoint-dir={ckpt}"), *sync]
    log = (tmp_path / "trainer.log").open("ab")

    def start_trainer() -> subprocess.Popen[bytes]:
        return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

    trainer = start_trainer()
    restarts = 0
    try:
        for victim, when in zip(victims, at):
            deadline = time.monotonic() + 120
            while newest_checkpoint(ckpt) < when:
                if trainer.poll() is not None:  # died of a shard's absence: the documented restart
                    restarts += 1
                    trainer = start_trainer()
                assert time.monotonic() < deadline, f"no progress to batch {when} in 120 s"
                time.sleep(0.005)
            time.sleep(rng.uniform(0, 0.05))
            if victim == "scale":
                shards.append(start_shard(2, 3, root, *SHARD_ARGS))
                procs.append(shards[-1])
                sizes.append(3)
                src, dst = ",".join(s.address for s in shards[:2]), ",".join(s.address for s in shards)
                ok(ps_admin("scale", "--addresses", src, "--to", dst, cwd=tmp_path))
            if victim in ("shard", "both"):
                k = rng.randrange(len(shards))
                port = shards[k].address.rsplit(":", 1)[1]
                os.kill(shards[k].proc.pid, signal.SIGKILL)
                shards[k].proc.wait()
            if victim in ("trainer", "both"):
                trainer.kill()
                trainer.wait()
            if victim in ("shard", "both"):
                shards[k] = start_shard(k, sizes[k], root, *SHARD_ARGS, listen=f"127.0.0.1:{port}")
                procs.append(shards[k])
            if trainer.poll() is not None:
                restarts += 1
                trainer = start_trainer()
        while (rc := trainer.wait(timeout=300)) != 0:
            restarts += 1
            assert restarts < 20, f"the trainer keeps failing (rc {rc}): see {tmp_path / 'trainer.log'}"
            trainer = start_trainer()
    finally:
        if trainer.poll() is None:
            trainer.kill()
        log.close()
    got = final_state(addresses, keys, tmp_path / "killed-out")
    assert sorted(got) == sorted(expected)
    differ = [name for name in expected if not np.array_equal(got[name], expected[name])]
    assert not differ, (
        f"after {len(victims)} events ({victims} at batches {at}): {differ} differ from the run never killed"
    )
    metrics = json.loads((tmp_path / "killed-out" / "metrics.json").read_text())
    assert metrics["batches"] == batches and metrics["rows"] == rows
    if scale:
        with PSClient(addresses) as client:
            assert {s["num_shards"] for s in client.admin.stats()} == {3}  # the map the shards route by now


@needs_criteo
def test_a_trainer_stopped_after_its_last_checkpoint_writes_the_run_when_started_again(
    tmp_path: Path, procs: list[RunningShard]
) -> None:
    """Stopped between its last checkpoint and writing the run (dense.pt, model, manifest),
    a trainer started again has no row left to read: it writes the run from the checkpoint."""
    data = tmp_path / "landed"
    land_files(data, 640, 320)
    shards = start_shards(tmp_path / "shards", procs)
    addresses = [s.address for s in shards]
    sync = ("--mode=sync", "--batch-size=64", "--checkpoint-every=1", "--validation-window=320")
    cmd = [*trainer_command(addresses, f"dir:{data}", tmp_path / "out", f"--checkpoint-dir={tmp_path / 'ckpt'}"), *sync]
    subprocess.run(cmd, check=True, cwd=REPO, timeout=600)
    finished = torch.load(tmp_path / "out" / "dense.pt", weights_only=True)
    for name in ("dense.pt", "model.pt2", "manifest.json"):  # as if stopped before it wrote them
        (tmp_path / "out" / name).unlink()
    again = subprocess.run(cmd, cwd=REPO, timeout=600, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stderr and "nothing trained" not in again.stderr, again.stderr[-3000:]
    written = torch.load(tmp_path / "out" / "dense.pt", weights_only=True)
    assert sorted(written) == sorted(finished)
    assert all(torch.equal(written[k], finished[k]) for k in finished)
    assert (tmp_path / "out" / "model.pt2").exists() and (tmp_path / "out" / "manifest.json").exists()


@needs_criteo
def test_shards_that_push_back_slow_the_trainer_without_losing_its_place(
    tmp_path: Path, procs: list[RunningShard]
) -> None:
    """Shards at their ``--threads`` limit (one call at a time, held most of the time by another
    client's large lookups) refuse the trainer's calls with RESOURCE_EXHAUSTED; it retries
    them after a backoff, says so, and ends bit-equal to a run the shards never refused."""
    data = tmp_path / "landed"
    land_files(data, 640, 320)
    keys = all_keys(data)
    sync = ("--mode=sync", "--batch-size=64", "--checkpoint-every=1", "--validation-window=320")

    def run(name: str, *shard_args: str, busy: bool = False) -> tuple[dict[str, np.ndarray], dict, str]:
        shards = [start_shard(i, 2, tmp_path / name, *SHARD_ARGS, *shard_args) for i in range(2)]
        procs.extend(shards)
        addresses = [s.address for s in shards]
        ckpt, out = tmp_path / f"{name}-ckpt", tmp_path / f"{name}-out"
        cmd = [*trainer_command(addresses, f"dir:{data}", out, f"--checkpoint-dir={ckpt}"), *sync]
        other = PSClient(addresses).start()
        if busy:  # a table of its own, whose lookups (50 MB answers) hold each shard's one call
            other.create_table("hammer", 256)
            hammer_keys = np.arange(50_000, dtype=np.int64)
            other.lookup("hammer", hammer_keys)
        log = tmp_path / f"{name}-trainer.log"
        with log.open("wb") as sink:
            trainer = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
            calls = 0
            while busy and trainer.poll() is None:
                other.lookup("hammer", hammer_keys)
                calls += 1
            trainer.wait(timeout=300)
        other.close()
        output = log.read_text()
        assert trainer.returncode == 0, output[-3000:]
        assert not busy or calls > 0, "the other client never called: the test proves nothing"
        state = final_state(addresses, keys, out)
        for s in shards:
            stop_shard(s)
        return state, json.loads((out / "metrics.json").read_text()), output

    expected, metrics, _ = run("calm")
    assert metrics["pushed_back_calls"] == 0
    got, metrics, output = run("busy", "--threads=1", busy=True)
    assert metrics["pushed_back_calls"] > 0, "no call was refused: the shards never pushed back"
    assert "RESOURCE_EXHAUSTED" in output and "the stream position is kept" in output
    assert metrics["rows"] == 640 and metrics["batches"] == 10
    differ = [name for name in expected if not np.array_equal(got[name], expected[name])]
    assert not differ, f"{differ} differ from the run the shards never refused"


@needs_criteo
def test_a_directory_run_scores_each_batch_before_training_and_serves(
    tmp_path: Path, procs: list[RunningShard]
) -> None:
    data = tmp_path / "landed"
    land_files(data, 1000, 250)
    with (data / "part-00000250.tsv").open("ab") as f:  # one malformed row in the middle
        f.write(b"not a row\n")
    shards = start_shards(tmp_path / "shards", procs)
    out = tmp_path / "out"
    cmd = trainer_command(
        [s.address for s in shards], f"dir:{data}", out, "--validation-window=500", "--bad-lines=skip"
    )
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["rows"] == 1000 and metrics["bad_lines"]["count"] == 1
    assert metrics["bad_lines"]["first"] == [f"{data / 'part-00000250.tsv'}:251"]
    windows = metrics["windows"]
    assert [w["window"] for w in windows] == [1, 2] and all(w["rows"] >= 500 for w in windows)
    assert all(0.0 < w["auc"] < 1.0 and w["logloss"] > 0 and w["calibration"] > 0 for w in windows)
    assert "window 2: rows=" in done.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["schema"]["source"] == "criteo" and len(manifest["features"]) == 2 * 39


def test_a_redis_stream_trains_until_idle(tmp_path: Path, procs: list[RunningShard]) -> None:
    import redis

    with redis_server(tmp_path / "redis") as port:
        r = redis.Redis("127.0.0.1", port)
        rng = np.random.default_rng(0)
        for i in range(600):  # IDs set here: 100 entries per 100 ms tick, whatever the machine's pace
            row = f"{int(rng.random() < 0.3)},{rng.integers(0, 9)},u{rng.integers(0, 50)}"
            r.xadd("clicks", {"row": row}, id=f"{10_000 + 100 * (i // 100)}-{i % 100}")
        schema = tmp_path / "clicks.toml"
        schema.write_text(
            'header = false\nnames = ["y", "n", "user"]\nlabel = "y"\n[columns]\nn = "numeric"\nuser = "categorical"\n'
        )
        last = r.xinfo_stream("clicks")["last-generated-id"].decode()
        shards = start_shards(tmp_path / "shards", procs)
        out = tmp_path / "out"
        cmd = trainer_command(
            [s.address for s in shards],
            f"redis://127.0.0.1:{port}/clicks",
            out,
            f"--schema={schema}",
            "--validation-window=200",
            "--batch-size=100",
        )
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["rows"] == 600 and len(metrics["windows"]) == 3
    assert metrics["position"] == {"last": last, "next": None}


def torchrun(workers: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}", *args]


@needs_criteo
def test_two_workers_split_the_stream_and_resume_as_a_group(tmp_path: Path, procs: list[RunningShard]) -> None:
    data = tmp_path / "landed"
    land_files(data, 2560, 320)  # 8 files, split between the workers by name
    shards = start_shards(tmp_path / "shards", procs)
    addresses = [s.address for s in shards]
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    trainer = trainer_command(
        addresses,
        f"dir:{data}",
        out,
        f"--checkpoint-dir={ckpt}",
        "--checkpoint-every=2",
        "--batch-size=64",
        "--validation-window=640",
    )
    cmd = torchrun(2, "-m", *trainer[2:])  # the trainer's module and flags, under torchrun
    log = (tmp_path / "trainer.log").open("ab")
    pids = tmp_path / "pids"
    env = {**os.environ, PID_DIR_ENV: str(pids)}  # each worker writes rank-R.pid there
    group = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 180
        while newest_checkpoint(ckpt) < 6:
            assert group.poll() is None and time.monotonic() < deadline, (tmp_path / "trainer.log").read_text()[-3000:]
            time.sleep(0.005)
        for pid in [*(int(p.read_text()) for p in pids.glob("rank-*.pid")), group.pid]:  # the group, mid-stream
            os.kill(pid, signal.SIGKILL)
        group.wait()
        resumed = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=600)
        assert resumed.returncode == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        wrong = subprocess.run(torchrun(1, "-m", *trainer[2:]), cwd=REPO, capture_output=True, text=True, timeout=600)
    finally:
        if group.poll() is None:
            group.kill()
        log.close()
    metrics = json.loads((out / "metrics.json").read_text())
    # Every row trained once, each by the worker owning its file: 5 batches of 64 per file of 320.
    assert metrics["workers"] == 2 and metrics["rows"] == 2560 and metrics["batches"] == 40
    text = (tmp_path / "trainer.log").read_text()
    assert "resuming from" in text and "published" in text and text.count("ending the run") == 1
    assert "rank=0 logger=worker.trainer msg=first batch trained" in text  # each worker had files
    assert "rank=1 logger=worker.trainer msg=first batch trained" in text
    assert wrong.returncode != 0 and "splits its stream over 2 workers, and 1 were started" in wrong.stderr
    assert (out / "manifest.json").exists()


@needs_criteo
def test_kill_anywhere_in_pipelined_mode_applies_every_push_once(tmp_path: Path, procs: list[RunningShard]) -> None:
    # The replay oracle: the trainer records every push it sends and every one it saw
    # acknowledged (tests/faults/recording_worker.py); the rows on the shards must equal an
    # in-process twin that applied each acknowledged push once, in order.
    from tests.integration.test_elastic_proof import pushed_keys, pushes_of, twin_rows

    data = tmp_path / "landed"
    land_files(data, 1920, 320)
    root, stream = tmp_path / "shards", tmp_path / "pushes"
    stream.mkdir()
    shards = [start_shard(i, 2, root, *SHARD_ARGS) for i in range(2)]
    procs.extend(shards)
    addresses = [s.address for s in shards]
    ckpt = tmp_path / "ckpt"
    flags = trainer_command(addresses, f"dir:{data}", tmp_path / "out", f"--checkpoint-dir={ckpt}")[3:]
    cmd = [sys.executable, "-m", "tests.faults.recording_worker", *flags, "--batch-size=64", "--checkpoint-every=3"]
    env = {**os.environ, "RECORD_STREAM": str(stream)}
    log = (tmp_path / "trainer.log").open("ab")

    def start_trainer() -> subprocess.Popen[bytes]:
        return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)

    def acked() -> int:
        acks = stream / "acks.txt"
        return len(acks.read_text().splitlines()) if acks.exists() else 0

    trainer = start_trainer()
    try:
        for victim, when in [("trainer", 7), ("shard", 14), ("trainer", 22)]:
            deadline = time.monotonic() + 120
            while acked() < when:
                if trainer.poll() is not None:
                    trainer = start_trainer()
                assert time.monotonic() < deadline, f"no progress to push {when} in 120 s"
                time.sleep(0.002)
            if victim == "trainer":
                trainer.kill()
                trainer.wait()
            else:
                port = shards[1].address.rsplit(":", 1)[1]
                os.kill(shards[1].proc.pid, signal.SIGKILL)
                shards[1].proc.wait()
                shards[1] = start_shard(1, 2, root, *SHARD_ARGS, listen=f"127.0.0.1:{port}")
                procs.append(shards[1])
            if trainer.poll() is not None:
                trainer = start_trainer()
        restarts = 0
        while (rc := trainer.wait(timeout=300)) != 0:
            restarts += 1
            assert restarts < 10, f"the trainer keeps failing (rc {rc}): see {tmp_path / 'trainer.log'}"
            trainer = start_trainer()
    finally:
        if trainer.poll() is None:
            trainer.kill()
        log.close()
    _, _, duplicates = pushes_of(stream)
    assert duplicates > 0  # pushes sent again after a restart, which the shards skipped
    keys = pushed_keys([stream])
    with PSClient(addresses) as client:
        got = client.lookup_many(keys)
    twins = twin_rows([stream], keys)
    assert any(all(np.array_equal(got[t], twin[t]) for t in keys) for twin in twins), (
        "the rows differ from every replay of the acknowledged pushes"
    )
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["rows"] == 1920 and metrics["batches"] == 30


def test_a_batch_with_a_nan_loss_is_not_trained_and_fails_its_window(tmp_path: Path) -> None:
    from client import PSClient as Client
    from deploy.local import LocalCluster
    from worker.config import TrainerConfig
    from worker.distributed import Dist
    from worker.guard import WindowGuard, finite
    from worker.loop import TrainingPass
    from worker.synthetic import synthetic_criteo

    config = TrainerConfig(mode="sync", dim=4)
    good, bad = list(synthetic_criteo(64, 32, seed=3))
    poisoned = dataclasses.replace(bad, dense=torch.full_like(bad.dense, float("nan")))
    with LocalCluster(2, root=tmp_path) as cluster, Client(cluster.addresses) as client:
        run = TrainingPass(config, Dist(), client, list(good.sparse), good.dense.shape[1])
        run.skip_nonfinite = True
        run.train(good, run.inputs(good), seq=1)
        keys = np.unique(np.concatenate([j.values.numpy() for j in bad.sparse.values()]))
        before = client.lookup("embedding", keys)
        weights = [p.detach().clone() for p in run.model.parameters()]
        run.train(poisoned, run.inputs(poisoned), seq=2)
        run.emb.flush()
        assert run.skipped == 1
        assert np.array_equal(client.lookup("embedding", keys), before)  # nothing pushed
        assert all(torch.equal(a, b) for a, b in zip(weights, run.model.parameters()))  # no dense step
        assert finite(run.model.parameters())
        run.close()
    failed = WindowGuard(0.02, 0.5, 2.0).check({"auc": 0.7, "calibration": 1.0}, skipped=run.skipped)
    assert [g for g, _ in failed] == ["nonfinite"]
