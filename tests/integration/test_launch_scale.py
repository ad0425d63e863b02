"""``ps-launch --scale``: a running launch grows and shrinks its shards (and the serving
shards following them) while its worker pushes and a reader looks up the followers.

The worker pushes the same gradient to every key in a loop (SGD, lr 1: exact float sums)
until told to stop, and saves what it saw acknowledged; every row must then be its first
value minus each acknowledged push once.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from client import ClientConfig, PSClient
from deploy.launch_scale import ADDRESSES_FILE, SERVING_ADDRESSES_FILE

REPO = Path(__file__).resolve().parents[2]
FAST = ClientConfig(backoff_initial_s=0.005, backoff_max_s=0.05, deadline_s=60.0, tune_malloc=False)

WORKER = textwrap.dedent(
    """
    import os, sys, numpy as np
    from pathlib import Path
    from client import ClientConfig, PSClient
    out = Path(sys.argv[1])
    keys = (np.arange(2000, dtype=np.int64) - 1000) * 7919
    config = ClientConfig(backoff_initial_s=0.005, backoff_max_s=0.05, deadline_s=60.0, tune_malloc=False)
    with PSClient(os.environ["TRAINER_ADDRESSES"].split(","), config, client_id="launch-scale") as ps:
        ps.create_table("t", 8, optimizer="sgd", lr=1.0, seed=5)
        start, acked = ps.lookup("t", keys), 0
        grads = np.full((keys.size, 8), 0.25, np.float32)
        (out / "started").touch()
        while not (out / "stop").exists():
            ps.push("t", keys, grads)
            acked += 1
        np.savez(out / "result.npz", keys=keys, start=start, final=ps.lookup("t", keys), acked=acked)
    """
)


def launch(*args: str) -> list[str]:
    return [sys.executable, "-m", "deploy.launch", *args]


def wait_for(path: Path, proc: subprocess.Popen[str], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"ps-launch exited {proc.returncode}"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def scale(log_dir: Path, to: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        launch("--scale", str(log_dir), "--to", str(to)), cwd=REPO, capture_output=True, text=True, timeout=300
    )


def test_a_launch_grows_shrinks_and_changes_its_replicas_while_its_worker_trains(tmp_path: Path) -> None:
    """2 shards with 2 serving replicas each grow to 3 and shrink back while the worker pushes;
    then the replicas go to 3 per shard, one is killed and replaced, and they go down to 1. A
    reader following the serving addresses file never fails, and every acknowledged push is
    applied once."""
    log_dir, out, worker = tmp_path / "launch", tmp_path / "out", tmp_path / "worker.py"
    out.mkdir()
    worker.write_text(WORKER)
    errors = (tmp_path / "launch.err").open("w")
    proc = subprocess.Popen(
        launch(
            "--shards",
            "2",
            "--serving-replicas",
            "2",
            "--max-restarts",
            "0",
            "--log-dir",
            str(log_dir),
            f"--shard-arg=--data-dir={tmp_path}/data/{{shard}}",
            "--shard-arg=--durability=every-push",
            "--shard-arg=--reshard-settle-s=1",
            "--",
            "python",
            str(worker),
            str(out),
        ),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=errors,
        text=True,
    )
    stop, failures, reads = threading.Event(), [], [0]
    try:
        wait_for(out / "started", proc)
        assert [len(s) for s in replicas_listed(log_dir)] == [2, 2]
        config = dataclasses.replace(FAST, membership_refresh_s=0.2)
        reader = PSClient(addresses_file=log_dir / SERVING_ADDRESSES_FILE, config=config)

        def read() -> None:
            while not stop.is_set():
                try:
                    reader.lookup("t", np.arange(500, dtype=np.int64) * 7919)
                    reads[0] += 1
                except Exception as exc:
                    failures.append(exc)

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        same = scale(log_dir, 2)
        assert same.returncode == 1 and "the launch has 2 shards" in same.stdout
        grown = scale(log_dir, 3)
        assert grown.returncode == 0, grown.stdout + grown.stderr
        assert "resharding from 2 to 3 shards" in grown.stdout and "committed" in grown.stdout
        assert len((log_dir / ADDRESSES_FILE).read_text().split(",")) == 3
        assert [len(s) for s in replicas_listed(log_dir)] == [2, 2, 2]
        shrunk = scale(log_dir, 2)
        assert shrunk.returncode == 0, shrunk.stdout + shrunk.stderr
        assert "stopped the 1 retired shards" in shrunk.stdout
        assert len((log_dir / ADDRESSES_FILE).read_text().split(",")) == 2
        assert [len(s) for s in replicas_listed(log_dir)] == [2, 2]
        more = replicas(log_dir, 3)
        assert more.returncode == 0, more.stdout + more.stderr
        assert [len(s) for s in replicas_listed(log_dir)] == [3, 3]
        victim = replicas_listed(log_dir)[0][0]
        os.kill(_pid_listening_at(log_dir, victim), signal.SIGKILL)  # the launch starts another in its place
        deadline = time.monotonic() + 60
        while victim in replicas_listed(log_dir)[0] or len(replicas_listed(log_dir)[0]) != 3:
            assert time.monotonic() < deadline, replicas_listed(log_dir)
            time.sleep(0.1)
        fewer = replicas(log_dir, 1)
        assert fewer.returncode == 0, fewer.stdout + fewer.stderr
        assert "stopped 4 serving replicas after their drain" in fewer.stdout
        assert [len(s) for s in replicas_listed(log_dir)] == [1, 1]
        stop.set()  # before the launch ends and its followers with it
        thread.join(60)
        reader.close()
        (out / "stop").touch()
        assert proc.wait(timeout=120) == 0
    finally:
        stop.set()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        errors.close()
    assert failures == [] and reads[0] > 0
    result = np.load(out / "result.npz")
    want = result["start"].copy()
    for _ in range(int(result["acked"])):
        want = want - np.float32(0.25)
    np.testing.assert_array_equal(result["final"], want)  # every acknowledged push once, none twice


def replicas(log_dir: Path, per_shard: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        launch("--scale", str(log_dir), "--serving-replicas", str(per_shard)),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def replicas_listed(log_dir: Path) -> list[list[str]]:
    return [shard.split("+") for shard in (log_dir / SERVING_ADDRESSES_FILE).read_text().strip().split(",")]


def _pid_listening_at(log_dir: Path, address: str) -> int:
    """The pid of the live shard process under ``log_dir`` whose port file names ``address``."""
    for cmdline in Path("/proc").glob("*/cmdline"):
        try:
            raw = cmdline.read_bytes()
            state = (cmdline.parent / "stat").read_text().split(") ")[-1][:1]
        except OSError:
            continue
        if f"--port-file={log_dir}".encode() in raw and state != "Z" and _port_of(raw) == address:
            return int(cmdline.parent.name)
    raise AssertionError(f"no process listens at {address}")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--scale", "{missing}", "--to", "3"], "the --log-dir of a running ps-launch"),
        (["--scale", "{missing}"], "--scale needs --to N"),
        (["--scale", "{missing}", "--to", "3", "--serving-replicas", "2"], "one of the two"),
        (["--scale", "{missing}", "--serving-replicas", "0"], "--serving-replicas 0: each shard needs at least 1"),
        (["--serving-replicas", "0", "--", "python"], "--serving-replicas 0: each shard needs at least 1"),
        (["--scale", "{missing}", "--to", "3", "--", "python"], "no '-- COMMAND'"),
        (["--to", "3", "--", "python"], "--to goes with --scale"),
    ],
)
def test_scale_asks_say_what_is_wrong_in_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    argv = [a.replace("{missing}", str(tmp_path / "nothing")) for a in args]
    result = subprocess.run(launch(*argv), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def _port_of(cmdline: bytes) -> str:
    """The address a shard's port file names (``127.0.0.1:PORT``), from its command line."""
    for arg in cmdline.split(b"\0"):
        if arg.startswith(b"--port-file="):
            path = Path(arg.split(b"=", 1)[1].decode())
            if path.exists():
                return f"127.0.0.1:{path.read_text().strip()}"
    return ""
