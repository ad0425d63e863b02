"""Training rides through shard failures: kill -9 shards under ps-launch and check every row.

The worker (``recording_worker.py``) logs every push its client saw acknowledged. After
the run, the shards are started again on their data dirs and every pushed key's row is
compared, bit for bit, with an in-process twin cluster that applied exactly the logged
pushes once each: a lost push or one applied twice changes rows. The same run without
kills gives the AUC to compare against.

A plain run kills shards 3 times; ``pytest -m slow`` runs the long version (10 kills).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from client import ClientConfig, PSClient, PSError
from protos.keys import shard_of
from ps.shard import Shard
from tests.fakes import InProcessTransport
from tests.integration.shards import shard_pid, start_shard, stop_shard
from tests.profiles import long_run

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("recording_worker.py")


def _pushes(client: PSClient) -> int:
    return sum(t["pushes"] for s in client.stats() for t in s["tables"])


def _train(tmp: Path, *, samples: int, kills: int, gap_s: float) -> dict[str, Any]:
    """One pipelined DLRM run under ps-launch (2 shards, every-push); ``kills`` kill -9s spaced ``gap_s`` apart."""
    launch_dir, data_dir, out = tmp / "launch", tmp / "data", tmp / "run"
    record = tmp / "pushes.pkl"
    command = [sys.executable, "-m", "deploy.launch", "--shards", "2", "--data-dir", str(launch_dir),
               f"--shard-arg=--data-dir={data_dir}/shard-{{shard}}", "--shard-arg=--durability=every-push",
               "--", "python", str(WORKER), "--mode", "pipelined", "--train-samples", str(samples),
               "--eval-samples", "10000", "--batch-size", "1024", "--progress", "false", "--seed", "3",
               "--output-dir", str(out)]  # fmt: skip
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, RECORD_PUSHES=str(record))
    log = (tmp / "launch.log").open("w")
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    killed: list[tuple[int, int]] = []
    try:
        deadline = time.monotonic() + 120
        while not all((launch_dir / f"port.{i}").exists() for i in range(2)):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp / "launch.log").read_text()[-3000:]
            time.sleep(0.1)
        addresses = [f"127.0.0.1:{(launch_dir / f'port.{i}').read_text().strip()}" for i in range(2)]
        with PSClient(addresses, ClientConfig(deadline_s=60, tune_malloc=False)) as watcher:
            while kills and proc.poll() is None and _pushes(watcher) < 30:
                time.sleep(0.1)  # training is under way
            for k in range(kills):
                time.sleep(gap_s)
                pid = shard_pid(launch_dir, k % 2)
                if proc.poll() is not None or pid is None:
                    break
                os.kill(pid, signal.SIGKILL)
                killed.append((k % 2, pid))
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    text = (tmp / "launch.log").read_text()
    assert code == 0, text[-4000:]
    metrics = json.loads((out / "metrics.json").read_text())
    with record.open("rb") as f:
        pushes = pickle.load(f)
    return {"metrics": metrics, "log": pushes, "killed": killed, "text": text, "data_dir": data_dir}


def _compare_rows(tmp: Path, run: dict[str, Any]) -> tuple[int, int, int]:
    """(pushes replayed, rows compared, rows that differ) between the restarted cluster and the twin."""
    log = run["log"]
    twin = PSClient(["inproc:0", "inproc:1"], ClientConfig(tune_malloc=False),
                    transport=InProcessTransport([Shard(0, 2), Shard(1, 2)]))  # fmt: skip
    keys: dict[str, set[int]] = {}
    with twin:
        for name, dim, options in log["tables"]:
            twin.create_table(name, dim, **options)
        for push in log["pushes"]:
            twin.push_many(push)
            for t, (k, _) in push.items():
                keys.setdefault(t, set()).update(k.tolist())
        wanted = {t: np.array(sorted(k), dtype=np.int64) for t, k in keys.items()}
        expected = twin.lookup_many(wanted)
    shards = [start_shard(i, 2, tmp / "verify", f"--data-dir={run['data_dir']}/shard-{i}") for i in range(2)]
    try:
        with PSClient([s.address for s in shards]) as real:
            actual = real.lookup_many(wanted)
    finally:
        for s in shards:
            stop_shard(s)
    rows = sum(len(v) for v in wanted.values())
    bad = {t: ~(expected[t] == actual[t]).all(axis=1) for t in wanted}
    differ = sum(int(b.sum()) for b in bad.values())
    for t, b in bad.items():
        if b.any():
            shards_of = np.bincount(shard_of(wanted[t][b], 2), minlength=2).tolist()
            print(f"table {t!r}: {int(b.sum())} of {len(b)} rows differ (by shard: {shards_of})")
    return len(log["pushes"]), rows, differ


@pytest.mark.slow
def test_training_rides_through_shard_kills(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    # A plain run: 3 kills in ~60 steps (~45 s on 2 cores); `pytest -m slow`: 10 kills in ~600.
    samples, kills, gap_s = (600_000, 10, 4.0) if long_run(request.config) else (60_000, 3, 1.5)
    faulty = _train(tmp_path / "faulty", samples=samples, kills=kills, gap_s=gap_s)
    clean = _train(tmp_path / "clean", samples=samples, kills=0, gap_s=0)
    pushes, rows, differ = _compare_rows(tmp_path, faulty)
    auc_faulty, auc_clean = faulty["metrics"]["final"]["auc"], clean["metrics"]["final"]["auc"]
    restarts = faulty["text"].count("restarting it on the same address")
    print(f"kills {len(faulty['killed'])}, restarts {restarts}, acknowledged pushes {pushes}, rows compared {rows}, "
          f"rows differing {differ}, AUC with kills {auc_faulty:.4f}, without {auc_clean:.4f}")  # fmt: skip
    assert len(faulty["killed"]) == kills, "training ended before every kill: raise the sample count"
    assert restarts == kills, faulty["text"][-3000:]
    assert not faulty["log"].get("mutated"), f"gradient arrays changed during pushes {faulty['log']['mutated']}"
    assert differ == 0, f"{differ} of {rows} rows differ from the replay of {pushes} acknowledged pushes"
    assert pushes == faulty["metrics"]["steps"]
    assert abs(auc_faulty - auc_clean) <= 0.003, (auc_faulty, auc_clean)


def test_failing_call_names_its_own_shard_and_address(tmp_path: Path) -> None:
    shards = [start_shard(i, 2, tmp_path) for i in range(2)]
    addresses = [s.address for s in shards]
    with PSClient(addresses) as ps:
        ps.create_table("t", 4)
    for s in shards:
        stop_shard(s)  # nothing listens on either address now
    config = ClientConfig(deadline_s=1.0, backoff_initial_s=0.05, backoff_max_s=0.2, tune_malloc=False)
    with PSClient(addresses, config) as ps:
        with pytest.raises(PSError) as info:
            ps.push("t", np.arange(64), np.ones((64, 4), np.float32))  # keys on both shards
    err = info.value
    assert err.shard is not None and err.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    mine, other = addresses[err.shard], addresses[1 - err.shard]
    assert f"shard {err.shard} ({mine})" in str(err)
    head, *others = str(err).split("; shard ")
    assert len(others) == 1, str(err)  # the other dead shard is named too
    assert other.rsplit(":", 1)[1] not in head, str(err)  # the main message quotes its own shard only
    assert all(o.startswith(f"{1 - err.shard} ({other}) failed too") for o in others), str(err)


def test_client_waits_for_a_restarting_shard(tmp_path: Path) -> None:
    data = tmp_path / "data"
    shard = start_shard(0, 1, tmp_path, f"--data-dir={data}", "--durability=every-push")
    address = shard.address
    with PSClient([address], ClientConfig(deadline_s=30, tune_malloc=False)) as ps:
        ps.create_table("t", 8, optimizer="sgd", lr=1.0)
        keys = np.arange(100)
        before = ps.lookup("t", keys)
        shard.proc.kill()
        shard.proc.wait()
        outcome: list[Any] = []

        def push() -> None:
            started = time.monotonic()
            try:
                ps.push("t", keys, np.ones((100, 8), np.float32))  # blocks until the shard is back
                outcome.append(time.monotonic() - started)
            except BaseException as exc:
                outcome.append(exc)

        # The push runs on a thread; the shard is restarted from this one (a shard gets
        # SIGTERM when the thread that started it ends).
        t = threading.Thread(target=push)
        t.start()
        time.sleep(2.0)  # longer than the old client's whole retry budget
        restarted = start_shard(0, 1, tmp_path, f"--data-dir={data}", "--durability=every-push", listen=address)
        t.join(60)
        after = ps.lookup("t", keys)
    stop_shard(restarted)
    assert len(outcome) == 1 and isinstance(outcome[0], float), outcome
    waited = outcome[0]
    assert waited > 1.5
    np.testing.assert_array_equal(after, before - 1.0)  # applied exactly once
