"""Guarded publish, as a user runs it: an online trainer on a directory files land in,
2 training shards, 2 serving shards started with ``--published-only`` and ``ps-infer``
on them, all real processes.

* Windows that pass their guards are published; serving moves to each, and ps-infer
  scores with the dense weights published with the rows it read. A serving shard started
  after a publication (the trainer quiet since) serves it at once.
* ``ps-admin publish --hold`` holds serving at the last publication while the trainer
  goes on; ``--release`` lets the next passing window through.
* ``ps-admin rollback`` serves the publication before again: the same scores, to the
  bit, as when it was first served.
* A poisoned file (labels flipped) fails its windows' guards: every Predict made while
  it trains scores as the last good publication did, bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from client import PSClient
from client.predict import PredictClient
from tests.integration.infer_helpers import Trained, start_infer, stop_infer
from tests.integration.shards import RunningShard, start_shard
from tests.integration.test_online import CRITEO, REPO, land_files, needs_criteo, trainer_command
from worker.data import ColumnSchema, raw_columns

WINDOW = 512


def admin(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "deploy.admin", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def served(serving: list[str]) -> set[str]:
    with PSClient(serving) as client:
        return {s["follow"]["publication"] for s in client.admin.stats()}


def wait_for(what: str, check, timeout_s: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.05)


def poisoned(directory: Path, name: str, start: int, rows: int) -> None:
    """Criteo rows ``[start, start + rows)`` with every label flipped, landed as one file."""
    lines = CRITEO.read_bytes().splitlines(keepends=True)[start : start + rows]
    flipped = [(b"1" if line[:1] == b"0" else b"0") + line[1:] for line in lines]
    (directory / f".{name}").write_bytes(b"".join(flipped))
    (directory / f".{name}").rename(directory / name)


@needs_criteo
def test_serving_moves_only_to_publications_that_passed_their_guards(tmp_path: Path, procs: list[RunningShard]) -> None:
    data = tmp_path / "landed"
    data.mkdir()
    train = [start_shard(i, 2, tmp_path / "train") for i in range(2)]
    procs.extend(train)
    training = [s.address for s in train]
    serve = [
        start_shard(i, 2, tmp_path / "serve", "--mode=serve", f"--follow={training[i]}", "--published-only=true")
        for i in range(2)
    ]
    procs.extend(serve)
    serving = [s.address for s in serve]
    out = tmp_path / "run"
    log = tmp_path / "trainer.log"
    cmd = trainer_command(training, f"dir:{data}", out, "--batch-size=128", f"--validation-window={WINDOW}")
    cmd[cmd.index("--idle-exit-s=1")] = "--idle-exit-s=600"  # this test ends it
    with log.open("wb") as sink:
        trainer = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
    infer = None
    try:
        # Three good windows: each passes and is published; serving follows.
        land_files(data, 3 * WINDOW, WINDOW)
        wait_for("publication 12 on the serving shards", lambda: served(serving) == {"000000000012"})
        # A serving shard started after the last publication serves it at once: the training
        # shard took no write since, so the snapshot it sends is that publication.
        late = start_shard(0, 2, tmp_path / "late", "--mode=serve", f"--follow={training[0]}", "--published-only=true")
        procs.append(late)
        wait_for(
            "publication 12 on a serving shard started after it", lambda: served([late.address]) == {"000000000012"}
        )
        infer = start_infer(Trained(serving, out), tmp_path, "infer")
        columns = raw_columns(CRITEO, ColumnSchema.criteo(), 9000, 200)
        predict = PredictClient(infer.address)
        at_12 = predict.predict({}, columns)

        # Held by hand: the next good window passes, is refused, and serving stays.
        assert "held: held by hand" in admin("publish", "--addresses", ",".join(training), "--hold")
        land_files(data, WINDOW, WINDOW, start=3 * WINDOW)
        wait_for("the held window", lambda: "publication 000000000016 refused" in log.read_text())
        assert served(serving) == {"000000000012"}
        assert np.array_equal(predict.predict({}, columns), at_12)

        # Released: the next passing window is published and served.
        assert "not held" in admin("publish", "--addresses", ",".join(training), "--release")
        land_files(data, WINDOW, WINDOW, start=4 * WINDOW)
        wait_for("publication 20 on the serving shards", lambda: served(serving) == {"000000000020"})
        wait_for("publication 20 on the late serving shard", lambda: served([late.address]) == {"000000000020"})
        at_20 = predict.predict({}, columns)
        assert not np.array_equal(at_20, at_12)

        # Rolled back by hand (held first, as the guide says): publication 12 again, to the bit.
        admin("publish", "--addresses", ",".join(training), "--hold")
        assert "serving publication 000000000012" in admin("rollback", "--addresses", ",".join(serving))
        assert served(serving) == {"000000000012"}
        assert np.array_equal(predict.predict({}, columns), at_12)
        admin("publish", "--addresses", ",".join(training), "--release")

        # Poisoned: its windows fail their guards; no Predict meanwhile scores otherwise.
        scores: list[np.ndarray] = []
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                scores.append(predict.predict({}, columns))

        loader = threading.Thread(target=load)
        loader.start()
        try:
            poisoned(data, "part-99999999.tsv", 6000, 2 * WINDOW)
            wait_for("both poisoned windows", lambda: log.read_text().count("failed its guards") >= 2)
            wait_for("Predicts after them", lambda: len(scores) >= 20)  # while and after it trains
        finally:
            stop.set()
            loader.join()
        assert served(serving) == {"000000000012"}
        assert all(np.array_equal(s, at_12) for s in scores), "a Predict saw poisoned rows"
    finally:
        if infer is not None:
            stop_infer(infer)
        trainer.terminate()
        trainer.wait(60)
    text = log.read_text()
    assert "below the trailing baseline" in text.split("failed its guards")[1].split("\n")[0], text[-3000:]
    assert (out / "published" / "000000000020" / "dense.pt").exists()


@needs_criteo
def test_published_only_needs_a_leader_and_rollback_needs_a_publication(
    tmp_path: Path, procs: list[RunningShard]
) -> None:
    train = start_shard(0, 1, tmp_path / "train")
    procs.append(train)
    serve = start_shard(0, 1, tmp_path / "serve", "--mode=serve", f"--follow={train.address}", "--published-only=true")
    procs.append(serve)
    done = subprocess.run(
        [sys.executable, "-m", "deploy.admin", "rollback", "--addresses", serve.address],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "no publication" in done.stderr and "Traceback" not in done.stderr
    bad = subprocess.run(
        [
            *(sys.executable, "-m", "ps", "--shard=0", "--num-shards=1", "--mode=serve"),
            *(f"--data-dir={tmp_path / 'rows'}", "--published-only=true"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "published_only needs mode=serve and follow" in bad.stderr
    with PSClient([train.address]) as client:
        answer = client.admin.publish("first")
    assert answer == [{"version": 0, "held": False, "followers": 1, "exact": 1, "published": "first", "held_by": ""}], (
        json.dumps(answer)
    )
