"""Workers come and go under ``ps-launch``: a worker killed with SIGKILL mid-epoch, and a
worker that joins a running group, each end in a run that exits 0 with every sparse
update applied exactly once.

The exact check: the shards count the keys of every push they apply (``Stats``, per
table), and a step's push carries its micro-batch's unique keys. So over a run, the keys
the shards applied must equal the sum over every micro-batch of every epoch of its unique
keys, computed here from the data: a micro-batch whose push was applied twice (or lost)
changes that sum, whatever order the pushes arrived in. The synthetic data makes a
micro-batch's keys a function of its epoch and index only.

A plain run is short; ``pytest -m slow`` runs them longer (400K samples, 2 epochs), also
trains the same run without the event and compares the AUC (within 0.003).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.profiles import long_run
from worker.synthetic import synthetic_criteo

REPO = Path(__file__).resolve().parents[2]
BATCH = 256
EVERY = 8  # steps between checkpoints


def _trainer_args(out: Path, samples: int, epochs: int) -> list[str]:
    return [
        "python",
        "-m",
        "worker.trainer",
        f"--train-samples={samples}",
        "--eval-samples=4096",
        f"--batch-size={BATCH}",
        f"--epochs={epochs}",
        f"--checkpoint-every={EVERY}",
        "--progress=false",
        f"--output-dir={out}",
    ]


class _Launch:
    """``ps-launch --workers W`` of the trainer, its log in ``root/launch.log``."""

    def __init__(self, root: Path, workers: int, samples: int, epochs: int) -> None:
        self.root, self.logs, self.out = root, root / "launch", root / "run"
        self.samples, self.epochs = samples, epochs
        root.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "deploy.launch", "--shards=2", f"--workers={workers}"]
        command += [f"--log-dir={self.logs}", "--", *_trainer_args(self.out, samples, epochs)]
        self.log = (root / "launch.log").open("w")
        self.proc = subprocess.Popen(command, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        self.started = time.monotonic()

    def text(self) -> str:
        return (self.root / "launch.log").read_text()

    def newest_checkpoint(self) -> int:
        """Step of the newest worker checkpoint (-1: none yet)."""
        steps = [int(p.name[11:20]) for p in self.logs.glob("checkpoint*/*/checkpoint-*.pt")]
        return max(steps, default=-1)

    def wait_for_checkpoint(self, step: int, timeout_s: float = 300) -> None:
        while self.newest_checkpoint() < step:
            assert self.proc.poll() is None, f"training ended before checkpoint {step}:\n{self.text()[-3000:]}"
            assert time.monotonic() - self.started < timeout_s, self.text()[-3000:]
            time.sleep(0.02)

    def workers(self) -> list[int]:
        """Pids of the trainer processes (not their torchrun agents)."""
        needle = f"--output-dir={self.out}".encode()
        pids = []
        for proc in Path("/proc").iterdir():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
                state = (proc / "stat").read_text().split(") ")[-1][:1]
            except OSError:
                continue
            launcher = b"deploy.workers" in argv or b"deploy.launch" in argv
            if needle in argv and b"worker.trainer" in argv and not launcher and state not in "ZX":
                pids.append(int(proc.name))
        return pids

    def finish(self, timeout_s: float = 600) -> dict[str, Any]:
        try:
            code = self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.log.close()
        assert code == 0, self.text()[-4000:]
        metrics: dict[str, Any] = json.loads((self.out / "metrics.json").read_text())
        return metrics


def _keys_of_every_micro_batch(samples: int, epochs: int) -> int:
    """The unique keys of each micro-batch, summed over the run: what the shards must have applied per table."""
    total = 0
    for epoch in range(epochs):
        for b in synthetic_criteo(samples, BATCH, seed=1000 * epoch):
            total += np.unique(np.concatenate([ids.values.numpy() for ids in b.sparse.values()])).shape[0]
    return total


def _check_exactly_once(metrics: dict[str, Any], samples: int, epochs: int) -> None:
    want = _keys_of_every_micro_batch(samples, epochs)
    applied = {t: v["keys_pushed"] for t, v in metrics["shards"]["tables"].items()}
    # Both tables take every key of a micro-batch: "embedding" its rows, "wide" its first-order weights.
    assert applied == {"embedding": want, "wide": want}, (applied, want)


@pytest.mark.slow
def test_a_worker_killed_mid_epoch_restarts_the_group_which_resumes(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    samples, epochs = (400_000, 2) if long_run(request.config) else (49_152, 2)
    run = _Launch(tmp_path / "killed", workers=2, samples=samples, epochs=epochs)
    run.wait_for_checkpoint(3 * EVERY)
    time.sleep(0.3)  # a few steps past the checkpoint: their pushes are sent again after the restart
    victims = run.workers()
    assert len(victims) == 2, victims
    # Each worker wrote its pid, by rank, where the launch logs: a script kills exactly that one.
    by_rank = {p.name: int(p.read_text()) for p in (run.logs / "workers").glob("rank-*.pid")}
    assert sorted(by_rank.values()) == sorted(victims), (by_rank, victims)
    os.kill(by_rank["rank-1.pid"], signal.SIGKILL)
    metrics = run.finish()
    text = run.text()
    assert "resuming from" in text and "failed (exitcode: -9)" in text, text[-4000:]
    assert not list((run.logs / "workers").glob("rank-*.pid")), "a worker that ended normally left its pid file"
    _check_exactly_once(metrics, samples, epochs)
    if long_run(request.config):
        clean = _Launch(tmp_path / "clean", workers=2, samples=samples, epochs=epochs).finish()
        auc, auc_clean = metrics["final"]["auc"], clean["final"]["auc"]
        print(f"AUC after a kill -9 {auc:.4f}, without {auc_clean:.4f}; pushes sent again {metrics['push_duplicates']}")
        assert abs(auc - auc_clean) <= 0.003


@pytest.mark.slow
def test_a_worker_that_joins_makes_the_group_restart_larger(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    samples, epochs = (400_000, 2) if long_run(request.config) else (65_536, 2)
    run = _Launch(tmp_path / "joined", workers=1, samples=samples, epochs=epochs)
    run.wait_for_checkpoint(EVERY)
    joiner = subprocess.run(
        [sys.executable, "-m", "deploy.launch", f"--join={run.logs}", "--workers=1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    metrics = run.finish()
    assert joiner.returncode == 0, joiner.stderr[-3000:]
    assert "joining 1 workers" in joiner.stderr
    assert len(metrics["dense_digests"]) == 2, "the group that finished had both workers"
    assert len(set(metrics["dense_digests"])) == 1, "DDP kept their dense models equal"
    assert "resuming from" in run.text()
    _check_exactly_once(metrics, samples, epochs)
    if long_run(request.config):
        clean = _Launch(tmp_path / "clean", workers=1, samples=samples, epochs=epochs).finish()
        auc, auc_clean = metrics["final"]["auc"], clean["final"]["auc"]
        print(f"AUC with a worker joining {auc:.4f}, without {auc_clean:.4f}")
        assert abs(auc - auc_clean) <= 0.003


def test_join_without_a_launch_says_what_is_missing(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "deploy.launch", f"--join={tmp_path}"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert f"{tmp_path}/workers.json does not exist: is {tmp_path} the --log-dir of a running ps-launch?" in lines[0]
